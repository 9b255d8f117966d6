"""SAELens's own transcoders against reward-lens's, run in a venv with SAELens (6.54 needs
transformer-lens < 4, so it cannot live beside reward-lens):

    python3 -m venv /work/venvs/saelens
    /work/venvs/saelens/bin/pip install torch==2.13.0
    /work/venvs/saelens/bin/pip install "sae-lens==6.54.*"

    # tiny transcoders saved by SAELens itself, with SAELens's activations (tests/test_transcoder_formats.py)
    /work/venvs/saelens/bin/python benchmarks/saelens_transcoders.py fixtures tests/data/saelens_transcoders
    # our exported files (benchmarks/transcoder_formats.py --out DIR) loaded by SAELens
    /work/venvs/saelens/bin/python benchmarks/saelens_transcoders.py check DIR

`check` loads DIR/saelens/layer_{l} with `SAE.load_from_disk` and compares SAELens's encode, decode and
forward on DIR/expected.safetensors's inputs with the activations reward-lens wrote there (goal: max
absolute difference <= 1e-6). Imports nothing from reward-lens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GOAL = 1e-6
D_IN, D_SAE, N = 8, 24, 32


def fixtures(out: Path) -> None:
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.transcoder import (
        JumpReLUSkipTranscoder,
        JumpReLUSkipTranscoderConfig,
        JumpReLUTranscoder,
        JumpReLUTranscoderConfig,
        SkipTranscoder,
        SkipTranscoderConfig,
    )

    g = torch.Generator().manual_seed(0)
    cases = {
        # positive thresholds (the exported form), negative ones (SAELens ReLUs first), no skip, plain ReLU
        "jumprelu_skip_transcoder": (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig, 1, (0.0, 0.6)),
        "jumprelu_skip_negative_thresholds": (
            JumpReLUSkipTranscoder,
            JumpReLUSkipTranscoderConfig,
            2,
            (-0.5, 0.5),
        ),
        "jumprelu_transcoder": (JumpReLUTranscoder, JumpReLUTranscoderConfig, 0, (0.0, 0.6)),
        "skip_transcoder": (SkipTranscoder, SkipTranscoderConfig, 3, None),
    }
    for name, (cls, cfg_cls, layer, thr) in cases.items():
        cfg = cfg_cls(
            d_in=D_IN, d_sae=D_SAE, d_out=D_IN, dtype="float32", device="cpu", apply_b_dec_to_input=False
        )
        cfg.metadata = SAEMetadata(
            model_name="tiny-llama",
            hook_name=f"blocks.{layer}.ln2.hook_normalized",
            hook_name_out=f"blocks.{layer}.hook_mlp_out",
        )
        sae = cls(cfg).eval()
        with torch.no_grad():
            for p in sae.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            if thr is not None:
                lo, hi = thr
                sae.threshold.copy_(lo + (hi - lo) * torch.rand(D_SAE, generator=g))
        d = out / name
        sae.save_model(d)
        x = torch.randn(N, D_IN, generator=g)
        with torch.no_grad():
            acts = sae.encode(x)
            expected = {"x": x, "feature_acts": acts, "decode": sae.decode(acts), "output": sae(x)}
        save_file({k: v.contiguous() for k, v in expected.items()}, str(d / "expected.safetensors"))
        print(f"{name}: layer {layer}, {int((acts > 0).sum())} of {acts.numel()} activations non-zero")
    (out / "README.md").write_text(
        f"Tiny transcoders saved by SAELens {sae_lens.__version__} itself (`SAE.save_model`) with SAELens's "
        "own\n"
        "encode (`feature_acts`), decode (`decode`, without the skip) and forward (`output`) on `x` in each\n"
        "expected.safetensors; written by `benchmarks/saelens_transcoders.py fixtures` in SAELens's venv.\n"
        "tests/test_transcoder_formats.py loads them with reward_lens.load_transcoders.\n"
    )


def check(directory: Path) -> int:
    import sae_lens
    from sae_lens import SAE

    expected = load_file(str(directory / "expected.safetensors"))
    worst, rows = 0.0, []
    for d in sorted((directory / "saelens").glob("layer_*"), key=lambda p: int(p.name.split("_")[1])):
        l = int(d.name.split("_")[1])
        sae = SAE.load_from_disk(d, device="cpu").eval()
        x = expected[f"x.{l}"]
        with torch.no_grad():
            acts = sae.encode(x)
            diffs = {
                "encode": float((acts - expected[f"acts.{l}"]).abs().max()),
                "decode": float((sae.decode(expected[f"acts.{l}"]) - expected[f"decode.{l}"]).abs().max()),
                "forward": float((sae(x) - expected[f"out.{l}"]).abs().max()),
            }
        same_support = bool(((acts != 0) == (expected[f"acts.{l}"] != 0)).all())
        rows.append({"layer": l, "class": type(sae).__name__, **diffs, "same_active_set": same_support})
        worst = max(worst, *diffs.values())
    result = {
        "sae_lens": sae_lens.__version__,
        "tokens": int(x.shape[0]),
        "layers": rows,
        "max_abs_diff": worst,
    }
    print(json.dumps(result, indent=1))
    ok = worst <= GOAL and all(r["same_active_set"] for r in rows)
    print(
        f"SAELens reproduces reward-lens's activations: max |diff| {worst:.2e} (goal <= {GOAL:g}): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("fixtures", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "fixtures":
        fixtures(Path(sys.argv[2]))
    else:
        sys.exit(check(Path(sys.argv[2])))
