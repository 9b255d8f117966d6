"""The feature graph's speed and memory on the SmolLM2 organism: one 128-token text, fp32, `--threads` CPU
threads, 1,024 feature rows and then 7,500 (`attribution_graph(..., max_features=N)`: the rows of the
features chosen by influence, as circuit-tracer chooses them), with the wall time, the process CPU time,
the peak RSS over each build (sampled every 20 ms, and the process's own high-water mark), and the coverage:
the share of the 7,500-row graph's feature-node influence held by the features with rows in the 1,024-row
graph. Baselines in the same run: one plain forward of the text, and with `--component-baseline` the
component graph (`attribution_graph` without transcoders). With `--naive-rows N`, N rows of the small graph
are rebuilt three ways and compared: as the graph builds them (position bands over text prefixes), in one
band over the whole text (every backward over all T positions), and the naive way (one forward of B copies
of the text per chunk, each row its own batch row).
Goals: 1,024 rows <= 120 s and <= 2 GB peak; 7,500 rows <= 600 s; coverage >= 95%.

    PYTHONPATH=. python benchmarks/feature_graph_speed.py --transcoders /tmp/smollm2_tc
    PYTHONPATH=. python benchmarks/feature_graph_speed.py --random-transcoders 1024   # timing only: untrained

Transcoders: a set trained by scripts/train_smollm2_transcoders.py, or `--random-transcoders D_TC` (seed 0,
random encoder rows: untrained, for timing only; its numbers say nothing about the graph's quality).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import threading
import time
from pathlib import Path

import torch

import reward_lens as rl
from reward_lens.instruments.circuits import feature_build as fb
from reward_lens.representations.transcoders import Transcoder, TranscoderSet

GOALS = {"rows_1024_s": 120.0, "rows_1024_peak_gb": 2.0, "rows_7500_s": 600.0, "coverage": 0.95}


def cpu_seconds() -> float:
    """This process's CPU time, all threads (what a contended wall clock does not show)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_gb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class PeakRSS:
    """The largest resident set size seen while the block runs (a 20 ms sampling thread)."""

    def __enter__(self):
        self.peak, self._stop = rss_gb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_gb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_gb())


def random_transcoders(model, d_tc: int, k: int, seed: int = 0) -> TranscoderSet:
    """Untrained transcoders of the model's width (random unit encoder rows, small decoder rows, a random
    skip): the graph's cost depends on T, L, k and d_tc, not on training."""
    g = torch.Generator().manual_seed(seed)
    d = model.cfg.d_model
    out = {}
    for l in range(model.cfg.n_layers):
        t = Transcoder(d, d_tc, k)
        with torch.no_grad():
            t.W_enc.copy_(torch.nn.functional.normalize(torch.randn(d_tc, d, generator=g), dim=-1))
            t.W_dec.copy_(0.05 * torch.randn(d_tc, d, generator=g) / d**0.5)
            t.W_skip.copy_(0.05 * torch.randn(d, d, generator=g) / d**0.5)
        out[l] = t
    return TranscoderSet(out, {"untrained": True, "seed": seed})


def text_of_length(model, T: int):
    """A held-out question with an answer made of held-out responses, cut to exactly T tokens at a word
    boundary that lands on T (the chat template's ending kept: the reward is read at <|im_end|>)."""
    pairs = rl.smollm2_pairs()
    words = " ".join(p.chosen for p in pairs).split()
    prompt = pairs[0].prompt
    for n in range(1, len(words)):
        ids = model.to_tokens(prompt, " ".join(words[:n]))["input_ids"][0]
        if ids.shape[0] >= T:
            if ids.shape[0] > T:  # overshoot by a multi-token word: the previous length is the closest
                ids = model.to_tokens(prompt, " ".join(words[: n - 1]))["input_ids"][0]
            return ids
    raise ValueError(f"not enough held-out text for {T} tokens")


def naive_rows(model, run, tc, cols, targets, chunk: int) -> torch.Tensor:
    """The rows by one forward of B copies of the text per chunk (each target its own batch row, its
    backward from its own pre-activation): the batched backward's independent reference."""
    rows = torch.zeros(len(targets), cols.n)
    chunks = [
        (l, idx)
        for l in sorted(set(targets[:, 0].tolist()))
        for idx in torch.nonzero(targets[:, 0] == l).flatten().split(chunk)
    ]
    for l, idx in chunks:
        B = len(idx)
        with torch.enable_grad():
            embed, writes = fb._leaves(run, B, range(l + 1))
            caps = fb.frozen_forward(model, run, tc, embed, lambda m, x: writes[m], stop=l + 1)
            x = caps["x"][l].float()[torch.arange(B), targets[idx, 1]]
            pre = (x * tc[l].W_enc.float()[targets[idx, 2]]).sum()
            grads = torch.autograd.grad(pre, [embed, *writes.values()], allow_unused=True)
        g_mlp = {m: fb._or_zeros(g, writes[m]) for m, g in zip(writes, grads[1:])}
        rows[idx] = fb.edges_from_grads(run, tc, cols, fb._or_zeros(grads[0], embed), g_mlp)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transcoders", default=None, help="a directory from train_smollm2_transcoders.py")
    ap.add_argument("--random-transcoders", type=int, default=None, metavar="D_TC")
    ap.add_argument("--k", type=int, default=32, help="k of the random transcoders")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rows", default="1024,7500")
    ap.add_argument("--naive-rows", type=int, default=0)
    ap.add_argument("--component-baseline", action="store_true", help="also time the component graph")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument(
        "--precision-rows",
        type=int,
        default=0,
        help="also: reward conservation of an N-row graph with the model and transcoders in fp32, then fp64",
    )
    args = ap.parse_args()
    if (args.transcoders is None) == (args.random_transcoders is None):
        ap.error("pass --transcoders DIR or --random-transcoders D_TC")
    torch.set_num_threads(args.threads)
    model = rl.load_smollm2_organism(device="cpu")
    if args.transcoders:
        tc, label = rl.load_transcoders(args.transcoders), f"trained ({args.transcoders})"
    else:
        tc = random_transcoders(model, args.random_transcoders, args.k)
        label = "RANDOM, untrained (timing only)"
    ids = text_of_length(model, args.tokens)
    result = {"transcoders": label, "d_tc": tc[0].d_tc, "k": tc[0].k, "T": int(ids.shape[0])}
    result["threads"] = args.threads
    result["rows_where"] = {}

    with torch.no_grad():
        model(ids[None])
        t0, c0 = time.perf_counter(), cpu_seconds()
        model(ids[None])
        result["forward_s"], result["forward_cpu_s"] = time.perf_counter() - t0, cpu_seconds() - c0
    if args.component_baseline:
        t0 = time.perf_counter()
        rl.attribution_graph(model, input_ids=ids)
        result["component_graph_s"] = time.perf_counter() - t0
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand the loader's freed buffers back: RSS = what is live
    result["rss_before_gb"] = rss_gb()

    graphs = {}
    for n in [int(s) for s in args.rows.split(",")]:
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), cpu_seconds()
            g = rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=n)
            seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        graphs[n] = g
        layers = g.nodes.layer.to_numpy()[g.row_nodes[:-1].numpy()]
        positions = g.nodes.position.to_numpy()[g.row_nodes[:-1].numpy()]
        result["rows_where"][n] = {
            "mean_layer": float(layers.mean()) if len(layers) else None,
            "mean_position": float(positions.mean()) if len(positions) else None,
        }
        result[f"rows_{n}"] = {
            "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1),
            "peak_rss_gb": round(mem.peak, 3),
            "peak_over_before_gb": round(mem.peak - result["rss_before_gb"], 3),
            "vs_forward": round(seconds / result["forward_s"], 1),
            "cpu_vs_forward_cpu": round(cpu / result["forward_cpu_s"], 1),
            "vs_component_graph": round(seconds / result.get("component_graph_s", float("nan")), 2),
            "n_targets": g.meta["n_targets"],
            "n_features": g.meta["n_features"],
            **{k: float(v) for k, v in g.completeness().items()},
        }
        print(json.dumps({f"rows_{n}": result[f"rows_{n}"]}), flush=True)
    result["process_peak_rss_gb"] = rss_gb("VmHWM")

    if len(graphs) >= 2:
        small, big = (graphs[n] for n in sorted(graphs)[:2])
        feats = big.nodes.kind.to_numpy() == "feature"
        influence = torch.tensor(big.nodes.influence.to_numpy())
        chosen = torch.zeros(len(feats), dtype=torch.bool)
        chosen[small.row_nodes[:-1]] = True  # same node order: the graphs share their columns
        rowed = torch.zeros(len(feats), dtype=torch.bool)
        rowed[big.row_nodes[:-1]] = True
        f = torch.from_numpy(feats)
        result["coverage"] = float(influence[chosen & f].sum() / influence[f].sum())
        result["coverage_of_rowed"] = float(influence[chosen & f].sum() / influence[rowed & f].sum())
        # the most any len(small) features could hold: the big graph's own top features by influence
        top = torch.sort(torch.where(f, influence, torch.zeros_like(influence)), descending=True).values
        result["coverage_best_possible"] = float(top[: len(small.row_nodes) - 1].sum() / influence[f].sum())
        result["small_rows_in_big"] = float((chosen & rowed).sum() / chosen.sum())
        # another reading of "node influence": every node's (features, errors, tokens), the small graph
        # covering its row features and every error and token node (both graphs have all of those)
        kinds = big.nodes.kind.to_numpy()
        shared = torch.from_numpy((kinds == "error") | (kinds == "embed"))
        held = influence[chosen & f].sum() + influence[shared].sum()
        result["coverage_all_nodes"] = float(held / (influence[f].sum() + influence[shared].sum()))

    if args.naive_rows:
        run = fb.clean_run(model, model_tok(model, ids), tc)
        cols = fb.columns(run)
        g = graphs[min(graphs)]
        targets = cols.features[g.row_nodes[: args.naive_rows]]
        t0, c0 = time.perf_counter(), cpu_seconds()
        fast = fb.target_rows(model, run, tc, cols, targets)
        fast_s, fast_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        t0, c0 = time.perf_counter(), cpu_seconds()
        whole = fb.target_rows(model, run, tc, cols, targets, bands=1, grad_bytes=2**40)
        whole_s, whole_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        t0, c0 = time.perf_counter(), cpu_seconds()
        slow = naive_rows(model, run, tc, cols, targets, chunk=64)
        slow_s, slow_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        scale = float(slow.abs().max())
        result["naive"] = {
            "rows": len(targets),
            "banded_s": round(fast_s, 2),
            "banded_cpu_s": round(fast_cpu, 2),
            "one_band_s": round(whole_s, 2),
            "one_band_cpu_s": round(whole_cpu, 2),
            "naive_s": round(slow_s, 2),
            "naive_cpu_s": round(slow_cpu, 2),
            "cpu_one_band_over_banded": round(whole_cpu / fast_cpu, 2),
            "cpu_naive_over_banded": round(slow_cpu / fast_cpu, 2),
            "banded_vs_naive_max_diff_rel": float((fast - slow).abs().max()) / max(scale, 1e-30),
            "one_band_vs_naive_max_diff_rel": float((whole - slow).abs().max()) / max(scale, 1e-30),
        }

    if args.precision_rows:
        result["precision"] = precision_check(model, tc, ids, args.precision_rows)

    verdict = {
        "rows_1024_s": result.get("rows_1024", {}).get("seconds"),
        "rows_1024_peak_gb": result.get("rows_1024", {}).get("peak_rss_gb"),
        "rows_7500_s": result.get("rows_7500", {}).get("seconds"),
        "coverage": result.get("coverage"),
    }
    result["verdicts"] = {
        k: (
            "n/a"
            if v is None
            else ("met" if (v >= GOALS[k] if k == "coverage" else v <= GOALS[k]) else "MISSED")
        )
        for k, v in verdict.items()
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def precision_check(model, tc, ids, rows: int) -> dict:
    """Reward conservation of the `rows`-row graph with the model and transcoders in fp32 and in fp64 (the
    graph builder itself works in fp32), and the reward row's sum of |edge| against R - bias: an error that
    shrinks with the inputs' precision and stays ~1e-6 of sum |edge| is rounding in a cancelling sum."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        tc.to(dtype)
        g = rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=rows)
        row = g.rows[g.row_nodes == g.reward_node][0]
        out[str(dtype).replace("torch.", "")] = {
            **g.completeness(),
            "reward_row_sum_abs_edge": float(row.abs().sum()),
            "reward_minus_bias": float(g.reward - g.bias),
            "error_over_sum_abs_edge": abs(float(row.sum()) - (g.reward - g.bias)) / float(row.abs().sum()),
        }
    model.to(torch.float32)
    tc.to(torch.float32)
    return out


def model_tok(model, ids):
    from reward_lens.instruments.circuits.attribution_graph import _single

    return _single(model, ids)


if __name__ == "__main__":
    main()
