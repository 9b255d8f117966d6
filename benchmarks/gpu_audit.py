"""One-command GPU benchmark: the audit pipeline on a randomly initialised Llama-3-8B-shaped reward model.

Builds `LlamaForSequenceClassification` (num_labels=1) from a `LlamaConfig` directly on the device in the
target dtype (random init, no download), converts it in memory (`HookedRewardModel.from_hf_model`), makes
`--pairs` synthetic token pairs with RewardBench-like lengths (log-normal prompt and response lengths, shared
prompt), and runs the audit's instruments: reward lens, exact attribution (components + heads), component
and head patching in all four modes (fast path), AtP (components + heads, all modes), all requested from one
pipeline call (`reward_lens.core.pipeline.run_pipeline`: the clean passes shared), then faithfulness. Prints
per-stage wall time, pairs/s, peak device memory, and the ratio of the total to transformers' bare forward
over the same batches (both responses of every pair, the same padding).

Full size (one H200; goal: total <= 3 min, pipeline / bare forward <= 4):
    python benchmarks/gpu_audit.py
Tiny, on CPU (what the test runs):
    python benchmarks/gpu_audit.py --device cpu --dtype float32 --layers 2 --d-model 64 --heads 4 \
        --kv-heads 2 --d-mlp 128 --vocab 512 --pairs 6 --max-len 48 --batch-size 4
"""

from __future__ import annotations

import argparse
import datetime
import math
import resource
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_lens import HookedRewardModel  # noqa: E402
from reward_lens.core.autobatch import BatchSize  # noqa: E402
from reward_lens.core.batching import pair_batches  # noqa: E402
from reward_lens.core.pipeline import CLEAN, run_pipeline  # noqa: E402
from reward_lens.core.ranks import Ranks  # noqa: E402
from reward_lens.data.pairs import TokenPair  # noqa: E402
from reward_lens.instruments import faithfulness  # noqa: E402
from reward_lens.instruments.attribution import AttributionSpec  # noqa: E402
from reward_lens.instruments.lens import LensSpec  # noqa: E402
from reward_lens.instruments.patching.atp import AtPSpec  # noqa: E402
from reward_lens.instruments.patching.contrastive import PatchSpec  # noqa: E402
from reward_lens.instruments.patching.spec import MODES  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d-mlp", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument(
        "--pairs", type=int, default=695, help="number of pairs (RewardBench's Chat subset: 358; 695 here)"
    )
    ap.add_argument("--max-len", type=int, default=2048, help="cap on prompt + response tokens")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-size", default="auto", help="an integer, or auto (halve on out-of-memory)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def lognormal_lengths(
    g: torch.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> torch.Tensor:
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g))
    return x.round().clamp(lo, hi).long()


def synthetic_pairs(n: int, vocab: int, max_len: int, seed: int):
    """RewardBench-like lengths: prompts median 64 tokens, responses median 200 (log-normal), capped at
    max_len."""
    g = torch.Generator().manual_seed(seed)
    p_len = lognormal_lengths(g, n, 64, 1.0, 4, max(4, max_len // 2))
    c_len = lognormal_lengths(g, n, 200, 0.8, 2, max_len)
    r_len = lognormal_lengths(g, n, 200, 0.8, 2, max_len)
    pairs = []
    for i in range(n):
        p = int(p_len[i])
        prompt = torch.randint(1, vocab, (p,), generator=g)
        c = torch.randint(1, vocab, (max(1, min(int(c_len[i]), max_len - p)),), generator=g)
        r = torch.randint(1, vocab, (max(1, min(int(r_len[i]), max_len - p)),), generator=g)
        pairs.append(TokenPair(torch.cat([prompt, c]), torch.cat([prompt, r]), prompt_len=p, id=f"syn-{i}"))
    return pairs


def build_hf(args, dtype: torch.dtype):
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_labels=1,
        pad_token_id=0,
        max_position_embeddings=max(8192, args.max_len),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(args.device):  # initialised where it runs, in its dtype: no host copy of the weights
        hf = transformers.LlamaForSequenceClassification._from_config(cfg, dtype=dtype)
    return hf.eval()


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_memory_gib(device: str) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # host RSS (KiB on Linux)


def reset_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


@torch.no_grad()
def bare_forward(hf, model, pairs, batch_size: int, device: str) -> float:
    """Seconds of transformers' own forward over every batch the instruments see (chosen and rejected)."""
    batches = list(pair_batches(model, pairs, batch_size))
    hf(batches[0].chosen.input_ids, attention_mask=batches[0].chosen.attention_mask)  # warm-up
    sync(device)
    start = time.perf_counter()
    for b in batches:
        for tok in (b.chosen, b.rejected):
            hf(tok.input_ids, attention_mask=tok.attention_mask)
    sync(device)
    return time.perf_counter() - start


SPECS = (
    ("reward lens", "lens"),
    ("exact attribution (components + heads)", "attribution"),
    ("component patching, 4 modes", "patch"),
    ("head patching, 4 modes", "patch:head"),
    ("AtP (components + heads), 4 modes", "atp"),
)


def specs():
    """The audit's instruments, requested together from one pipeline (their clean passes shared)."""
    return [
        LensSpec(),
        AttributionSpec(heads=True),
        PatchSpec(mode=list(MODES), level="component"),
        PatchSpec(mode=list(MODES), level="head"),
        AtPSpec(mode=list(MODES), level=["component", "head"]),
    ]


def timed(dev: str, fn):
    reset_peak(dev)
    sync(dev)
    start = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    dev = args.device
    t0 = time.perf_counter()
    hf = build_hf(args, dtype)
    model = HookedRewardModel.from_hf_model(hf, device=dev, dtype=dtype)
    sync(dev)
    build_s = time.perf_counter() - t0
    pairs = synthetic_pairs(args.pairs, args.vocab, args.max_len, args.seed)
    n_tokens = sum(len(p.chosen) + len(p.rejected) for p in pairs)
    batch = BatchSize.parse(
        args.batch_size if args.batch_size == "auto" else int(args.batch_size), dev, echo=print
    )
    bare_s = batch.run(lambda bs, hf=hf: bare_forward(hf, model, pairs, bs, dev))
    del hf
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(torch.device(dev)) if torch.device(dev).type == "cuda" else "CPU"
    print(
        f"# gpu_audit {datetime.date.today()} on {name}: {args.layers} layers, d_model {args.d_model}, "
        f"{args.heads} heads ({args.kv_heads} kv), d_mlp {args.d_mlp}, vocab {args.vocab}, {args.dtype}; "
        f"{len(pairs)} pairs, {n_tokens} tokens (mean {n_tokens / (2 * len(pairs)):.0f} per response); "
        f"model built in {build_s:.1f} s"
    )
    print(f"| stage | wall s | pairs/s | peak {'GPU' if name != 'CPU' else 'host RSS'} GiB |")
    print("|---|---:|---:|---:|")
    spent: dict = {}
    out, took = timed(
        dev, lambda: run_pipeline(model, pairs, specs(), batch_size=batch, ranks=Ranks(), timings=spent)
    )
    peak = peak_memory_gib(dev)
    # Per stage: its own computation on the shared captures; the clean passes (one forward per side and
    # batch) are shared by all of them and get their own row.
    rows = [(stage, spent.get(key, 0.0)) for stage, key in SPECS] + [
        ("shared clean passes (one forward per side and batch)", spent.get(CLEAN, 0.0)),
        ("pipeline total", took),
    ]
    for stage, seconds in rows:
        print(f"| {stage} | {seconds:.4f} | {len(pairs) / max(seconds, 1e-9):.1f} | {peak:.2f} |", flush=True)
    results = {stage: out[key] for stage, key in SPECS}
    results["faithfulness"], faith_s = timed(
        dev,
        lambda: faithfulness(
            results["exact attribution (components + heads)"],
            results["component patching, 4 modes"],
            mode="noising",
        ),
    )
    print(
        f"| faithfulness | {faith_s:.4f} | {len(pairs) / faith_s:.1f} | {peak_memory_gib(dev):.2f} |",
        flush=True,
    )
    total = took + faith_s
    print(f"| **total** | {total:.2f} | {len(pairs) / total:.1f} | |")
    print(
        f"bare transformers forward over the same batches: {bare_s:.2f} s; pipeline / bare forward = "
        f"{total / bare_s:.2f}; batch size {batch.size} (started at {batch.initial})"
    )
    print(
        f"faithfulness (noising): mean rho {results['faithfulness'].mean_rho:+.3f}; attribution max "
        f"relative error {results['exact attribution (components + heads)'].max_relative_error():.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
