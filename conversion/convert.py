"""Convert an HF reward checkpoint into a saved hooked checkpoint (reward_lens_config.json + safetensors).

    python conversion/convert.py PATH_OR_ID OUT_DIR [--dtype bfloat16] [--no-fold-ln]

The output loads with HookedRewardModel.from_pretrained(OUT_DIR) without transformers' weight maps or remote
code, and carries the tokenizer files.
"""

import argparse

from reward_lens import HookedRewardModel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-fold-ln", dest="fold_ln", action="store_false", default=True)
    args = ap.parse_args(argv)
    model = HookedRewardModel.from_pretrained(args.checkpoint, dtype=args.dtype, fold_ln=args.fold_ln)
    model.save_pretrained(args.out_dir)
    print(
        f"saved {model.cfg.original_architecture} ({model.cfg.n_layers} layers, d_model "
        f"{model.cfg.d_model}, fold_ln={args.fold_ln}, {args.dtype}) to {args.out_dir}"
    )


if __name__ == "__main__":
    main()
