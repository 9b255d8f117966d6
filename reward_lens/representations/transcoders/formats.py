"""Transcoders in the formats other tools read: circuit-tracer's per-layer layout and SAELens's
`jumprelu_skip_transcoder`, written and read back; and the conversion of a TopK set to the JumpReLU form
both tools load.

circuit-tracer (a directory, as its hub repos and its local cache hold a transcoder set):

    config.yaml            model_kind: transcoder_set, feature_input_hook: ln2.hook_normalized,
                           feature_output_hook: hook_mlp_out, model_name, scan (+ `reward_lens`, which
                           circuit-tracer ignores: the source family, k and the calibration)
    layer_{l}.safetensors  W_enc [d_tc, d_model], W_dec [d_tc, d_model], b_enc [d_tc], b_dec [d_model],
                           W_skip [d_model, d_model] (only with a skip), activation_function.threshold [d_tc]

circuit-tracer applies its JumpReLU as pre * (pre > threshold) and needs layers 0..max, each present.

SAELens (one directory per layer, `layer_{l}/`, each what `SAE.load_from_disk` reads):

    cfg.json                 architecture jumprelu_skip_transcoder (jumprelu_transcoder without a skip),
                             d_in, d_sae, d_out, apply_b_dec_to_input false, metadata.hook_name /
                             hook_name_out (blocks.{l}.ln2.hook_normalized / blocks.{l}.hook_mlp_out)
    sae_weights.safetensors  W_enc [d_model, d_tc] (transposed from ours), W_dec [d_tc, d_model], b_enc,
                             b_dec, threshold [d_tc], W_skip [d_model, d_model] (x @ W_skip.T, as ours)

SAELens applies relu(pre) * (pre > threshold), which equals pre * (pre > threshold) for thresholds >= 0;
the exports write only non-negative thresholds, and SAELens files with negative ones load with their
thresholds raised to 0 (the same map).

TopK has no fixed threshold: `convert.jumprelu_from_topk` sets one per feature from calibration text;
BatchTopK's inference rule already is a JumpReLU, and the writers export it as is.

This module works on tensors and the set's attributes only: readers return each layer's weights
(`LayerWeights`), which `module.load_transcoders` turns into transcoders, so the dependency points down
(`module` imports `formats`, never the reverse).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from reward_lens.loading.checks import check_finite_weights, load_safetensors, read_json
from reward_lens.model.hooks import mlp_input_name as input_hook
from reward_lens.model.hooks import mlp_output_name as output_hook

CIRCUIT_TRACER_CONFIG = "config.yaml"
SAELENS_CFG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
INPUT_HOOK, OUTPUT_HOOK = "ln2.hook_normalized", "hook_mlp_out"  # within blocks.{l}
SAELENS_ARCHITECTURES = ("jumprelu_skip_transcoder", "jumprelu_transcoder", "skip_transcoder", "transcoder")
SAELENS_FORMAT_VERSION = "6.0.0"
_LAYER_FILE = re.compile(r"layer_(\d+)\.safetensors$")
_LAYER_DIR = re.compile(r"layer_(\d+)$")
# One layer as read from another tool's files: d_model, d_tc, k, skip, and the tensors W_enc [d_tc, d_model],
# b_enc, W_dec, b_dec, threshold, W_skip (absent without a skip); `module.load_transcoders` builds the
# JumpReLU transcoder from it.
LayerWeights = Dict[str, Any]


def holds_circuit_tracer(path: Path) -> bool:
    """Whether the directory `path` is in circuit-tracer's layout (has its config.yaml)."""
    return (Path(path) / CIRCUIT_TRACER_CONFIG).exists()


def holds_saelens(path: Path) -> bool:
    """Whether `path` is an SAELens directory, or holds `layer_{l}/` ones."""
    path = Path(path)
    return (path / SAELENS_CFG).exists() or any(
        (d / SAELENS_CFG).exists() for d in path.glob("layer_*") if _LAYER_DIR.match(d.name)
    )


def export_thresholds(tc, tool: str) -> Dict[int, torch.Tensor]:
    """Each layer's JumpReLU threshold as the tools apply it: a JumpReLU set's own, a BatchTopK set's
    inference threshold (its rule is this JumpReLU, so the export is exact); a TopK set is refused."""
    kinds = {tc[l].kind for l in tc.layers}
    if "topk" in kinds:
        raise ValueError(
            f"{tool} loads JumpReLU transcoders, not TopK ones; convert first with "
            "jumprelu_from_topk(tc, model, texts) (thresholds calibrated on training-distribution text)"
        )
    if len(kinds) > 1:
        raise ValueError(f"cannot export a set of families {sorted(kinds)}; convert one family at a time")
    out = {}
    for l in tc.layers:
        threshold = tc[l].threshold.detach()
        if kinds == {"batchtopk"}:
            threshold = threshold.clamp(min=0.0)  # never fires a negative pre-activation (its ReLU)
        elif bool((threshold < 0).any()):
            raise ValueError(
                f"layer {l} has negative JumpReLU thresholds, which {tool} would apply differently "
                "(SAELens ReLUs first); raise them to 0 only if no negative pre-activation should fire"
            )
        out[l] = threshold
    return out


def _conversion_note(tc) -> Dict[str, Any]:
    if "jumprelu" in tc.config:
        return dict(tc.config["jumprelu"])
    if tc[tc.layers[0]].kind == "batchtopk":
        return {"source_family": "batchtopk", "exact": True}
    return {}


# --- circuit-tracer ----------------------------------------------------------------------------------


def save_circuit_tracer(
    tc, path: Union[str, Path], *, model_name: Optional[str] = None, scan: Optional[str] = None
) -> Path:
    """Write circuit-tracer's per-layer transcoder layout (config.yaml + layer_{l}.safetensors); load it
    there with `load_transcoder_set({l: path/layer_{l}.safetensors}, ...)`, from a hub repo holding the
    directory, or with reward_lens.load_transcoders(path)."""
    import yaml
    from safetensors.torch import save_file

    thresholds = export_thresholds(tc, "circuit-tracer")
    if tc.layers != list(range(len(tc))):
        raise ValueError(
            f"circuit-tracer needs a transcoder for every layer 0..{max(tc.layers)}; this set covers "
            f"{tc.layers} (train the missing layers)"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for l in tc.layers:
        t = tc[l]
        tensors = {
            "W_enc": t.W_enc,
            "W_dec": t.W_dec,
            "b_enc": t.b_enc,
            "b_dec": t.b_dec,
            "activation_function.threshold": thresholds[l],
        }
        if t.W_skip is not None:
            tensors["W_skip"] = t.W_skip
        save_file(
            {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()},
            str(path / f"layer_{l}.safetensors"),
        )
    name = model_name or str(tc.config.get("model_name") or "") or "reward-model"
    first = tc[tc.layers[0]]
    config = {
        "model_kind": "transcoder_set",
        "model_name": name,
        "scan": scan or f"{name}-transcoders",
        "feature_input_hook": INPUT_HOOK,
        "feature_output_hook": OUTPUT_HOOK,
        "reward_lens": {
            "family": "jumprelu",
            "k": first.k,
            "d_model": first.d_model,
            "d_tc": first.d_tc,
            **({"jumprelu": note} if (note := _conversion_note(tc)) else {}),
        },
    }
    (path / CIRCUIT_TRACER_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _check_hooks(source: str, hook_in: Optional[str], hook_out: Optional[str], layer: Optional[int]) -> None:
    want_in = INPUT_HOOK if layer is None else input_hook(layer)
    want_out = OUTPUT_HOOK if layer is None else output_hook(layer)
    if hook_in != want_in or (hook_out is not None and hook_out != want_out):
        raise ValueError(
            f"{source}: these transcoders read {hook_in!r} and write {hook_out!r}; reward-lens's transcoders "
            f"map {want_in!r} to {want_out!r} (the MLP's normalised input to its output)"
        )


def read_circuit_tracer(path: Union[str, Path]) -> Tuple[Dict[int, LayerWeights], Dict[str, Any]]:
    """Each layer's JumpReLU weights and the set's info from circuit-tracer's per-layer layout (config.yaml
    + layer_{l}.safetensors; ReLU transcoders, with no threshold, read as threshold 0)."""
    import yaml

    path = Path(path)
    try:
        config = yaml.safe_load((path / CIRCUIT_TRACER_CONFIG).read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path / CIRCUIT_TRACER_CONFIG} is not valid YAML ({exc}); repair it") from None
    if config.get("model_kind", "transcoder_set") != "transcoder_set":
        raise ValueError(
            f"{path}: model_kind {config.get('model_kind')!r}; reward-lens reads per-layer transcoder sets "
            "(model_kind: transcoder_set), not cross-layer transcoders"
        )
    _check_hooks(str(path), config.get("feature_input_hook"), config.get("feature_output_hook"), None)
    files = {int(m.group(1)): f for f in path.iterdir() if (m := _LAYER_FILE.match(f.name))}
    if not files:
        raise FileNotFoundError(f"{path} has a config.yaml but no layer_{{l}}.safetensors files")
    extra = config.get("reward_lens") or {}
    out = {}
    for l, f in sorted(files.items()):
        sd = load_safetensors(f)
        for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
            if name not in sd:
                raise ValueError(f"{f}: lacks {name!r} (has {sorted(sd)}); not a circuit-tracer transcoder")
        d_tc, d_model = sd["W_enc"].shape
        shapes = {
            "W_dec": (d_tc, d_model),
            "b_enc": (d_tc,),
            "b_dec": (d_model,),
            "W_skip": (d_model, d_model),
        }
        shapes["activation_function.threshold"] = (d_tc,)
        for name, shape in shapes.items():
            if name in sd and tuple(sd[name].shape) != shape:
                raise ValueError(f"{f}: {name} has shape {tuple(sd[name].shape)}, W_enc implies {shape}")
        check_finite_weights(sd.items(), str(f))
        weights = {
            name: sd[name].float() for name in ("W_enc", "W_dec", "b_enc", "b_dec", "W_skip") if name in sd
        }
        weights["threshold"] = sd.get("activation_function.threshold", torch.zeros(d_tc)).float()
        out[l] = dict(weights, d_model=d_model, d_tc=d_tc, k=int(extra.get("k", 0)), skip="W_skip" in sd)
    info = {
        "model_name": config.get("model_name", ""),
        "format": "circuit-tracer",
        "scan": config.get("scan"),
    }
    if "jumprelu" in extra:
        info["jumprelu"] = extra["jumprelu"]
    return out, info


# --- SAELens -----------------------------------------------------------------------------------------


def saelens_config(t, layer: int, model_name: str) -> Dict[str, Any]:
    """One layer's cfg.json in SAELens's (>= 6) transcoder format."""
    return {
        "architecture": "jumprelu_skip_transcoder" if t.W_skip is not None else "jumprelu_transcoder",
        "d_in": t.d_model,
        "d_sae": t.d_tc,
        "d_out": t.d_model,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": False,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": SAELENS_FORMAT_VERSION,
            "sae_lens_training_version": SAELENS_FORMAT_VERSION,
            "model_name": model_name,
            "hook_name": input_hook(layer),
            "hook_name_out": output_hook(layer),
            "hook_head_index": None,
            "prepend_bos": True,
        },
    }


def save_saelens(tc, path: Union[str, Path], *, model_name: Optional[str] = None) -> Path:
    """Write each layer as an SAELens `jumprelu_skip_transcoder` directory, `path/layer_{l}/` (cfg.json +
    sae_weights.safetensors, W_enc transposed to SAELens's [d_in, d_sae]); load one there with
    `SAE.load_from_disk(path/layer_{l})`, or the set with reward_lens.load_transcoders(path)."""
    from safetensors.torch import save_file

    thresholds = export_thresholds(tc, "SAELens")
    name = model_name or str(tc.config.get("model_name") or "") or "reward-model"
    path = Path(path)
    for l in tc.layers:
        t = tc[l]
        d = path / f"layer_{l}"
        d.mkdir(parents=True, exist_ok=True)
        tensors = {"W_enc": t.W_enc.T, "W_dec": t.W_dec, "b_enc": t.b_enc, "b_dec": t.b_dec}
        tensors["threshold"] = thresholds[l]
        if t.W_skip is not None:
            tensors["W_skip"] = t.W_skip
        save_file(
            {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, str(d / SAELENS_WEIGHTS)
        )
        (d / SAELENS_CFG).write_text(json.dumps(saelens_config(t, l, name), indent=1) + "\n")
    return path


def read_saelens_transcoder(path: Union[str, Path]) -> Tuple[int, LayerWeights, str]:
    """(layer, its JumpReLU weights, model name) from one SAELens transcoder directory (architectures
    jumprelu_skip_transcoder, jumprelu_transcoder, skip_transcoder, transcoder)."""
    path = Path(path)
    raw = read_json(path / SAELENS_CFG)
    arch = raw.get("architecture")
    if arch not in SAELENS_ARCHITECTURES:
        raise ValueError(
            f"{path}: SAELens architecture {arch!r} is not a transcoder reward-lens reads; use one of "
            f"{', '.join(SAELENS_ARCHITECTURES)} (SAEs load with reward_lens.load_sae)"
        )
    meta = raw.get("metadata") or {}
    hook_in = meta.get("hook_name") or raw.get("hook_name")
    hook_out = meta.get("hook_name_out") or raw.get("hook_name_out")
    m = re.match(r"blocks\.(\d+)\.", str(hook_in))
    if m is None:
        raise ValueError(f"{path}: hook_name {hook_in!r} names no layer (expected blocks.{{l}}.{INPUT_HOOK})")
    layer = int(m.group(1))
    _check_hooks(str(path), hook_in, hook_out, layer)
    if raw.get("normalize_activations", "none") not in ("none", None, False):
        raise ValueError(
            f"{path}: normalize_activations={raw['normalize_activations']!r}; reward-lens reads transcoders "
            "on raw activations ('none')"
        )
    if raw.get("apply_b_dec_to_input"):
        raise ValueError(f"{path}: apply_b_dec_to_input is set, which SAELens transcoders do not support")
    d_in, d_sae, d_out = int(raw["d_in"]), int(raw["d_sae"]), int(raw.get("d_out", raw["d_in"]))
    if d_out != d_in:
        raise ValueError(
            f"{path}: d_out={d_out} differs from d_in={d_in}; an MLP transcoder maps d_model to itself"
        )
    weights = path / SAELENS_WEIGHTS
    sd = {k: v.float() for k, v in load_safetensors(weights).items()}
    skip = "skip" in arch
    expected = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,)}
    if arch.startswith("jumprelu"):
        expected["threshold"] = (d_sae,)
    if skip:
        expected["W_skip"] = (d_in, d_in)
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"{weights}: lacks {name!r} (has {sorted(sd)})")
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{weights}: {name} has shape {tuple(sd[name].shape)}, cfg.json implies {shape}")
    check_finite_weights(((k, sd[k]) for k in expected), str(weights))
    weights = {"W_enc": sd["W_enc"].T.contiguous()}
    weights.update({name: sd[name] for name in ("W_dec", "b_enc", "b_dec", "W_skip") if name in expected})
    # relu(pre) * (pre > thr) == pre * (pre > max(thr, 0)); plain ReLU transcoders are threshold 0
    weights["threshold"] = sd.get("threshold", torch.zeros(d_sae)).clamp(min=0.0)
    weights.update(d_model=d_in, d_tc=d_sae, k=0, skip=skip)
    return layer, weights, meta.get("model_name") or raw.get("model_name") or ""


def read_saelens(path: Union[str, Path]) -> Tuple[Dict[int, LayerWeights], Dict[str, Any]]:
    """Each layer's JumpReLU weights and the set's info from SAELens transcoder directories: `path` itself
    (one layer) or its `layer_{l}/` subdirectories (as `save_saelens` writes)."""
    path = Path(path)
    dirs = (
        [path]
        if (path / SAELENS_CFG).exists()
        else sorted(
            (d for d in path.iterdir() if _LAYER_DIR.match(d.name) and (d / SAELENS_CFG).exists()),
            key=lambda d: int(d.name.split("_")[1]),
        )
    )
    out, names = {}, set()
    for d in dirs:
        layer, weights, name = read_saelens_transcoder(d)
        if layer in out:
            raise ValueError(f"{path}: two SAELens transcoders for layer {layer}; keep one per layer")
        out[layer] = weights
        names.add(name)
    return out, {"model_name": sorted(names)[0] if names else "", "format": "saelens"}


# format name -> writer(tc, path); (holds(path), read(path)) for a directory not in reward-lens's own format
WRITERS = {"circuit-tracer": save_circuit_tracer, "saelens": save_saelens}
READERS = ((holds_circuit_tracer, read_circuit_tracer), (holds_saelens, read_saelens))
