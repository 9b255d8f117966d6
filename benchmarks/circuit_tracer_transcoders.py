"""circuit-tracer's own transcoder loader against reward-lens's export, run in a venv with circuit-tracer
(it needs transformers <= 4.57, so it cannot live beside reward-lens):

    python3 -m venv /work/venvs/circuit-tracer
    /work/venvs/circuit-tracer/bin/pip install torch==2.13.0
    /work/venvs/circuit-tracer/bin/pip install circuit-tracer==0.5.0 "transformers<=4.57.*"

    # a tiny set saved by circuit-tracer itself, with its activations (tests/test_transcoder_formats.py)
    /work/venvs/circuit-tracer/bin/python benchmarks/circuit_tracer_transcoders.py fixtures \
        tests/data/circuit_tracer_transcoders
    # our exported files (benchmarks/transcoder_formats.py --out DIR) loaded by circuit-tracer
    /work/venvs/circuit-tracer/bin/python benchmarks/circuit_tracer_transcoders.py check DIR

`check` loads DIR/circuit_tracer twice, through circuit-tracer's local-directory loader
(`load_transcoders_from_cache`, which reads config.yaml and layer_*.safetensors) and through
`load_transcoder_set` with the hooks from config.yaml, and compares encode, decode (with and without the
skip) with the activations reward-lens wrote to DIR/expected.safetensors (goal: max absolute difference
<= 1e-6). Imports nothing from reward-lens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

GOAL = 1e-6


def _load_both(directory: Path):
    from circuit_tracer.transcoder.single_layer_transcoder import load_transcoder_set
    from circuit_tracer.utils.caching import load_transcoders_from_cache

    cached, config = load_transcoders_from_cache(
        directory.name, cache_dir=directory.parent, device=torch.device("cpu"), dtype=torch.float32
    )
    files = sorted(directory.glob("layer_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    direct = load_transcoder_set(
        {int(p.stem.split("_")[1]): str(p) for p in files},
        scan=config.get("scan"),
        feature_input_hook=config["feature_input_hook"],
        feature_output_hook=config["feature_output_hook"],
        device=torch.device("cpu"),
        dtype=torch.float32,
        lazy_encoder=False,
        lazy_decoder=False,
    )
    return {"load_transcoders_from_cache": cached, "load_transcoder_set": direct}, config


def check(directory: Path) -> int:
    import circuit_tracer

    expected = load_file(str(directory / "expected.safetensors"))
    sets, config = _load_both(directory / "circuit_tracer")
    worst, rows = 0.0, []
    for loader, ts in sets.items():
        assert ts.skip_connection and ts.feature_input_hook == "ln2.hook_normalized"
        for l in range(ts.n_layers):
            t = ts[l]
            x, acts = expected[f"x.{l}"], expected[f"acts.{l}"]
            with torch.no_grad():
                got = t.encode(x)
                diffs = {
                    "encode": float((got - acts).abs().max()),
                    "decode_no_skip": float((acts @ t.W_dec + t.b_dec - expected[f"decode.{l}"]).abs().max()),
                    "decode_with_skip": float((t.decode(acts, x) - expected[f"out.{l}"]).abs().max()),
                    "forward": float((t(x) - expected[f"out.{l}"]).abs().max()),
                }
            rows.append(
                {
                    "loader": loader,
                    "layer": l,
                    "activation": type(t.activation_function).__name__,
                    **diffs,
                    "same_active_set": bool(((got != 0) == (acts != 0)).all()),
                }
            )
            worst = max(worst, *diffs.values())
    version = getattr(circuit_tracer, "__version__", None) or _dist_version("circuit-tracer")
    result = {"circuit_tracer": version, "config": config, "layers": rows, "max_abs_diff": worst}
    print(json.dumps(result, indent=1, default=str))
    ok = worst <= GOAL and all(r["same_active_set"] for r in rows)
    print(
        f"circuit-tracer reproduces reward-lens's activations: max |diff| {worst:.2e} (goal <= {GOAL:g}): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def fixtures(out: Path) -> None:
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet

    g = torch.Generator().manual_seed(0)
    d_model, d_tc, n_layers, n = 8, 24, 2, 32
    transcoders = {}
    for l in range(n_layers):
        # layer 0 with some negative thresholds (circuit-tracer fires pre > threshold, negative pre too)
        lo = -0.3 if l == 0 else 0.0
        threshold = lo + 0.8 * torch.rand(d_tc, generator=g)
        t = SingleLayerTranscoder(
            d_model,
            d_tc,
            JumpReLU(threshold, 0.1),
            l,
            skip_connection=True,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        with torch.no_grad():
            for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip"):
                p = getattr(t, name)
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        transcoders[l] = t
    ts = TranscoderSet(transcoders, "ln2.hook_normalized", "hook_mlp_out", scan="tiny-llama-transcoders")
    out.mkdir(parents=True, exist_ok=True)
    ts.to_safetensors(str(out))
    config = {
        "model_kind": "transcoder_set",
        "model_name": "tiny-llama",
        "scan": "tiny-llama-transcoders",
        "feature_input_hook": "ln2.hook_normalized",
        "feature_output_hook": "hook_mlp_out",
    }
    (out / "config.yaml").write_text(yaml.dump(config))  # as circuit-tracer's cache writes it
    expected = {}
    for l in range(n_layers):
        x = torch.randn(n, d_model, generator=g)
        with torch.no_grad():
            acts = ts[l].encode(x)
            expected.update({f"x.{l}": x, f"acts.{l}": acts, f"out.{l}": ts[l].decode(acts, x)})
    save_file({k: v.contiguous() for k, v in expected.items()}, str(out / "expected.safetensors"))
    # the directory loads back through circuit-tracer's own local loader
    back, _ = _load_both(out)
    for ts_back in back.values():
        assert all(
            torch.equal(ts_back[l].encode(expected[f"x.{l}"]), expected[f"acts.{l}"]) for l in range(n_layers)
        )
    (out / "README.md").write_text(
        f"A tiny transcoder set saved by circuit-tracer {_dist_version('circuit-tracer')} itself "
        "(`TranscoderSet.to_safetensors`, config.yaml as its local cache\nwrites it) with circuit-tracer's "
        "own "
        "encode (`acts.{l}`) and decode with the skip (`out.{l}`) on `x.{l}` in expected.safetensors;\n"
        "written by `benchmarks/circuit_tracer_transcoders.py fixtures` in circuit-tracer's venv. "
        "tests/test_transcoder_formats.py loads it\nwith reward_lens.load_transcoders.\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("fixtures", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "fixtures":
        fixtures(Path(sys.argv[2]))
    else:
        sys.exit(check(Path(sys.argv[2])))
