"""Parity harness: run a transformers reward model and its HookedRewardModel side by side.

    python conversion/parity.py PATH_OR_ID [--dtype float32] [--device cpu] [--fold-ln/--no-fold-ln]
                                [--text "prompt|||response" ...]

Prints, per layer, the max |hidden-state difference| over non-pad positions, then the reward error, and a
one-line summary to paste into conversion/KNOWN_CHECKPOINTS.md. Positions ids are given to transformers as
cumsum(attention_mask) - 1, as the hooked model uses, so left padding compares like for like.
"""

import argparse
import sys

import torch

from reward_lens import HookedRewardModel
from reward_lens.loading.checkpoint import load_hf_config, resolve_checkpoint_dir
from reward_lens.model.devices import resolve_dtype

DEFAULT_PAIRS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    (
        "Write a haiku about autumn.",
        "Leaves drift slowly down,\ncrimson on the quiet path,\nthe year exhales cold.",
    ),
    ("Is it safe to mix bleach and ammonia?", "No. Mixing them releases toxic chloramine gas."),
]


def build_hf_model(directory, hf_config, dtype, device):
    import transformers

    arch = hf_config.architectures[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise SystemExit(
            f"transformers has no class {arch}; the parity harness needs the reference implementation "
            "(for remote-code models such as ArmoRM, use the tests' reference implementation instead)"
        )
    model = cls.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--fold-ln",
        dest="fold_ln",
        action="store_true",
        default=False,
        help="fold norm weights (default off, so hidden states are comparable layer by layer)",
    )
    ap.add_argument("--text", action="append", help='a "prompt|||response" pair; repeatable')
    ap.add_argument("--padding-side", default="right", choices=["left", "right"])
    args = ap.parse_args(argv)

    directory = resolve_checkpoint_dir(args.checkpoint)
    dtype = resolve_dtype(args.dtype)
    hf_config = load_hf_config(directory)
    hf = build_hf_model(directory, hf_config, dtype, args.device)
    hooked = HookedRewardModel.from_pretrained(
        directory, device=args.device, dtype=dtype, fold_ln=args.fold_ln
    )
    pairs = [tuple(t.split("|||", 1)) for t in args.text] if args.text else DEFAULT_PAIRS
    if hooked.tokenizer is not None:
        batch = hooked.to_tokens([p for p, _ in pairs], [r for _, r in pairs], padding_side=args.padding_side)
        ids, mask = batch["input_ids"], batch["attention_mask"]
    else:
        print("checkpoint has no tokenizer: using random token ids", file=sys.stderr)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, hooked.cfg.d_vocab, (3, 24), generator=g).to(args.device)
        mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        rewards, cache = hooked.run_with_cache(
            ids, attention_mask=mask, names_filter=lambda n: n.endswith("hook_resid_post")
        )
    valid = mask[..., None].bool()
    worst = 0.0
    print(f"{'layer':>6} {'max |hidden diff|':>18} {'max |hidden|':>14}")
    for layer in range(hooked.cfg.n_layers - 1):
        ours, theirs = cache[f"blocks.{layer}.hook_resid_post"].float(), ref.hidden_states[layer + 1].float()
        err = ((ours - theirs) * valid).abs().max().item()
        worst = max(worst, err)
        print(f"{layer:>6} {err:>18.3e} {theirs.abs().max().item():>14.3e}")
    ref_rewards = ref.logits.float()
    ref_rewards = ref_rewards[:, 0] if ref_rewards.shape[-1] == 1 else ref_rewards
    reward_err = (rewards.float() - ref_rewards).abs().max().item()
    print(f"rewards hooked:       {rewards.float().tolist()}")
    print(f"rewards transformers: {ref_rewards.tolist()}")
    n = hooked.cfg.n_layers
    print(
        f"SUMMARY {args.checkpoint} dtype={args.dtype} device={args.device} fold_ln={args.fold_ln}: "
        f"max reward error {reward_err:.3e}, max hidden-state error {worst:.3e} over layers 0-{n - 2} of {n} "
        "(transformers' last hidden state is after the final norm: the reward error covers the last layer)"
    )
    return reward_err, worst


if __name__ == "__main__":
    main()
