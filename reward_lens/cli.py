"""The `reward-lens` command line."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from reward_lens import __version__


def _tiny_example() -> int:
    """Interim main job until the full audit lands: a tiny random Llama RM, converted and checked."""
    import torch
    import transformers

    from reward_lens import HookedRewardModel

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    hf = transformers.LlamaForSequenceClassification(cfg).eval()
    model = HookedRewardModel.from_hf_model(hf)
    ids = torch.randint(1, 64, (2, 10))
    rewards, cache = model.run_with_cache(ids)
    with torch.no_grad():
        ref = hf(ids).logits[:, 0]
    stack = cache.decompose_resid(apply_ln=True)[:, :, -1] @ model.reward_direction
    print(f"rewards hooked {rewards.tolist()}  transformers {ref.tolist()}")
    print(f"sum of {stack.shape[0]} component terms + bias: {(stack.sum(0) + model.reward_bias).tolist()}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="reward-lens", description="Mechanistic interpretability for reward models.")
    parser.add_argument("--version", action="version", version=f"reward-lens {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser("audit", help="audit a reward model (default: the embedded demo model)")
    audit.add_argument("--model")
    audit.add_argument("--pairs")
    audit.add_argument("--out", default="reward-lens-report")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return _tiny_example()
    return 1


if __name__ == "__main__":
    sys.exit(main())
