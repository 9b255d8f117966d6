"""Where a SmolLM2 organism transcoder set loses the reward: per-layer FVU over every token and with each
text's first token left out (the chat template's `<|endoftext|>`, where some layers write almost all their
output variance: an attention sink), that token's share of each layer's output variance, and the
replacement model's reward (no error terms) against the original with every layer replaced, every layer
but the first token, and each layer alone (but the first token, for a set trained without it): Pearson r,
chosen/rejected decisions kept, mean |reward change|.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/transcoder_replacement.py --transcoders /tmp/smollm2_tc

Held-out pairs as scripts/train_smollm2_transcoders.py evaluates them (`--pairs` evenly spread over the 160,
both sides). Deterministic (no sampling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import reward_lens as rl  # noqa: E402
from reward_lens.core.batching import tokenize  # noqa: E402
from reward_lens.representations.transcoders.module import input_hook, output_hook  # noqa: E402
from reward_lens.representations.transcoders.train import mlp_io, token_rows  # noqa: E402
from scripts.train_smollm2_transcoders import held_out_subset  # noqa: E402  (the script's evaluation pairs)


def first_positions(tok) -> torch.Tensor:
    """[batch, pos] bool: each row's first attended token (the one `exclude_first_token` leaves out)."""
    return tok.attention_mask.bool() & ~token_rows(tok, exclude_first=True)


def fvu_table(model, tc, toks) -> None:
    layers = tc.layers
    sse = torch.zeros(2, len(layers), dtype=torch.float64)
    ys: list = [[], []]
    for tok in toks:
        x, y = mlp_io(model, tok, layers)
        is_first = first_positions(tok)[tok.attention_mask.bool()]
        for i, l in enumerate(layers):
            err = (y[:, i] - tc[l](x[:, i])).double().pow(2).sum(-1)
            sse[0, i] += err.sum()
            sse[1, i] += err[~is_first].sum()
        ys[0].append(y.double())
        ys[1].append(y[~is_first].double())
    everything = torch.cat(ys[0])
    for j, label in enumerate(("every token", "first token left out")):
        Y = torch.cat(ys[j])
        fvu = sse[j] / (Y - Y.mean(0)).pow(2).sum((0, 2))
        print(
            f"FVU, {label} ({len(Y)} tokens): mean {float(fvu.mean()):.4f}, max {float(fvu.max()):.4f} "
            f"(layer {layers[int(fvu.argmax())]})"
        )
        print("   " + " ".join(f"{l}:{float(v):.3f}" for l, v in zip(layers, fvu)))
    rest = torch.cat(ys[1])
    centre = everything.mean(0)
    share = 1 - (rest - centre).pow(2).sum((0, 2)) / (everything - centre).pow(2).sum((0, 2))
    print("first token's share of the output variance:")
    print("   " + " ".join(f"{l}:{float(v):.2f}" for l, v in zip(layers, share)))


def replaced_rewards(model, tc, toks, layers, exempt_first: bool = False) -> np.ndarray:
    """Rewards with `layers`' MLP outputs replaced by their transcoders' (the first token's kept)."""
    out = []
    for tok in toks:
        first = first_positions(tok)
        seen = {}

        def grab(x, hook):
            seen[hook.name] = x

        def replace(y, hook):
            layer = int(hook.name.split(".")[1])
            new = tc[layer](seen.pop(input_hook(layer))).to(y.dtype)
            return torch.where(first[..., None], y, new) if exempt_first else new

        hooks = [h for l in layers for h in ((input_hook(l), grab), (output_hook(l), replace))]
        with torch.no_grad():
            out.append(model.run_with_hooks(tok.input_ids, tok.attention_mask, fwd_hooks=hooks).float())
    return torch.cat(out).numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transcoders", required=True, help="a directory from train_smollm2_transcoders.py")
    ap.add_argument("--pairs", type=int, default=64, help="held-out pairs (both sides)")
    ap.add_argument("--replace-pairs", type=int, default=24, help="pairs for the replacement rows")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = rl.load_smollm2_organism(device="cpu")
    tc = rl.load_transcoders(args.transcoders)

    def batches(pairs):
        prompts = [p.prompt for p in pairs for _ in (0, 1)]
        responses = [getattr(p, side) for p in pairs for side in ("chosen", "rejected")]
        starts = range(0, len(prompts), 16)
        return [tokenize(model, prompts[s : s + 16], responses[s : s + 16]) for s in starts]

    fvu_table(model, tc, batches(held_out_subset(args.pairs)))
    toks = batches(held_out_subset(args.replace_pairs))
    original = replaced_rewards(model, tc, toks, [])
    print(f"replacement model, {args.replace_pairs} pairs (reward std {original.std():.3f}):")

    def row(label, r):
        pearson = np.corrcoef(original, r)[0, 1]
        kept = np.mean(np.sign(original[0::2] - original[1::2]) == np.sign(r[0::2] - r[1::2]))
        print(f"| {label} | {pearson:+.3f} | {kept:.2f} | {np.abs(r - original).mean():.3f} |", flush=True)

    print("| replaced | Pearson r | decisions kept | mean abs reward change |\n|---|---:|---:|---:|")
    row("every layer", replaced_rewards(model, tc, toks, tc.layers))
    row("every layer, first token kept", replaced_rewards(model, tc, toks, tc.layers, exempt_first=True))
    keep_first = tc.exclude_first_token  # a set trained without the first token leaves it to the MLP
    for l in tc.layers:
        label = f"layer {l} alone" + (", first token kept" if keep_first else "")
        row(label, replaced_rewards(model, tc, toks, [l], exempt_first=keep_first))


if __name__ == "__main__":
    main()
