"""The hacking probes scored over their shared prefixes next to plain forwards, measured in one run.

    OMP_NUM_THREADS=1 python benchmarks/probe_prefix_sharing.py --organism smollm2 --repeats 2
    OMP_NUM_THREADS=1 python benchmarks/probe_prefix_sharing.py --organism demo --repeats 5

Prints the probe texts' attended tokens, the tokens the plain path runs (batches sorted by length, each
padded to its longest), the tokens of their radix trees (`model.shared_prefix_run`, 64 texts to a tree),
the audit's pairs' tokens and how many of them repeat a pair's prompt (`--tokens-only` stops there), then
`run_probes` both ways, interleaved (`--repeats` rounds; this process's CPU seconds, which another process
taking the core does not inflate, and wall seconds), the ratio of the medians, and the largest reward
difference and whether verdicts and p-values agree.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reward_lens.core.batching import length_order, pair_batches, take_rows, tokenize  # noqa: E402
from reward_lens.core.readout import TEXTS_PER_TREE  # noqa: E402
from reward_lens.model.suffix import prefix_tree  # noqa: E402
from reward_lens.probes.suite import DIMENSIONS, _key, _resolve_items, run_probes  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--organism", choices=["demo", "smollm2"], default="smollm2")
    ap.add_argument("--batch-size", type=int, default=8, help="the audit's batch size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--items", type=int, default=None, help="only the first N probe items")
    ap.add_argument("--tokens-only", action="store_true", help="print the token counts and stop")
    return ap.parse_args(argv)


def token_counts(model, items, batch_size: int):
    """(attended tokens, the plain path's padded tokens, the trees' tokens) of the probe texts."""
    texts, originals = {}, []
    for dim in DIMENSIONS.values():
        for i, item in enumerate(items):
            prompt, a, b = dim.make(item, i)
            for r in (a, b):
                if texts.setdefault(_key(prompt, r), len(texts)) == len(originals):
                    originals.append((prompt, r))
    tok = tokenize(model, [p for p, _ in originals], [r for _, r in originals])
    order = length_order(tok)
    padded = sum(
        take_rows(model, tok, order[s : s + batch_size]).input_ids.numel()
        for s in range(0, len(order), batch_size)
    )
    rows = sorted(tok.input_ids[r][tok.attention_mask[r].bool()].tolist() for r in range(len(originals)))
    tree = sum(
        prefix_tree(rows[s : s + TEXTS_PER_TREE]).n_tokens for s in range(0, len(rows), TEXTS_PER_TREE)
    )
    return len(originals), int(tok.attention_mask.sum()), padded, tree


def pair_tokens(model, pairs, batch_size: int):
    """(attended tokens of both responses of every pair, tokens of the second copy of each shared prompt)."""
    total = shared = 0
    for b in pair_batches(model, pairs, batch_size):
        total += int(b.chosen.attention_mask.sum() + b.rejected.attention_mask.sum())
        shared += int(b.prompt_len.sum())
    return total, shared


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.organism == "smollm2":
        from reward_lens.demo.smollm2 import load_smollm2_organism, smollm2_pairs

        model, pairs = load_smollm2_organism(device="cpu"), smollm2_pairs()
    else:
        from reward_lens.demo import demo_pairs, load_demo_model

        model, pairs = load_demo_model(device="cpu"), demo_pairs()
    items = _resolve_items(model, None)[: args.items]
    n, real, padded, tree = token_counts(model, items, args.batch_size)
    print(
        f"# probe_prefix_sharing {datetime.date.today()}: {args.organism}, {len(items)} items, {n} texts, "
        f"batch size {args.batch_size}, 1 thread; tokens: attended {real}, plain path {padded} (padded), "
        f"trees {tree} ({tree / padded:.2f} of the plain path's)"
    )
    total, shared = pair_tokens(model, pairs, args.batch_size)
    print(
        f"the audit's {len(pairs)} pairs: {total} attended tokens, of which {shared} ({shared / total:.2f}) "
        "repeat the pair's prompt in its second response"
    )
    if args.tokens_only:
        return 0
    runs = {False: [], True: []}
    results = {}
    for _ in range(args.repeats):
        for shared in (False, True):
            wall, cpu = time.perf_counter(), time.process_time()
            results[shared] = run_probes(model, items, batch_size=args.batch_size, shared_prefixes=shared)
            runs[shared].append((time.process_time() - cpu, time.perf_counter() - wall))
            label = "shared prefixes" if shared else "plain"
            print(f"  {label}: {runs[shared][-1][0]:.2f} CPU s, {runs[shared][-1][1]:.2f} wall s", flush=True)
    for kind, k in (("cpu", 0), ("wall", 1)):
        plain = statistics.median(r[k] for r in runs[False])
        shared = statistics.median(r[k] for r in runs[True])
        print(
            f"{kind}: plain {plain:.2f} s ({', '.join(f'{r[k]:.2f}' for r in runs[False])}), shared prefixes "
            f"{shared:.2f} s ({', '.join(f'{r[k]:.2f}' for r in runs[True])}); shared / plain = "
            f"{shared / plain:.2f}"
        )
    a, b = results[False], results[True]
    diff = max(float(np.abs(a.per_item[c] - b.per_item[c]).max()) for c in ("reward_a", "reward_b"))
    scale = max(float(np.abs(a.per_item[c]).max()) for c in ("reward_a", "reward_b"))
    fa, fb = a.to_frame(), b.to_frame()
    same_verdicts = fa.verdict.tolist() == fb.verdict.tolist()
    same_p = fa.p_value.tolist() == fb.p_value.tolist()
    ends = float(np.abs(fa[["ci_low", "ci_high"]].to_numpy() - fb[["ci_low", "ci_high"]].to_numpy()).max())
    print(
        f"max |reward difference| {diff:.2e} (largest |reward| {scale:.2f}); same verdicts: {same_verdicts}; "
        f"same p-values: {same_p}; largest interval-end difference {ends:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
