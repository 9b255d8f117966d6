"""SAELens's disk format (>= 6, and directories written by older versions): the config, reading and
writing. Needs neither sae_lens nor the SAE module (the module builds on this)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from reward_lens.loading.checks import check_finite_weights, load_safetensors, read_json

SAE_CFG_FILENAME = "cfg.json"
SAE_WEIGHTS_FILENAME = "sae_weights.safetensors"
SPARSITY_FILENAME = "sparsity.safetensors"  # SAELens's optional log10 firing-frequency file
TRAINING_FILENAME = "reward_lens_training.json"  # ours: hyperparameters and metrics (SAELens ignores it)
ARCHITECTURES = ("topk", "standard", "jumprelu")
# The SAELens config-format version our cfg.json follows; SAELens treats files without one as pre-6.0.
SAELENS_FORMAT_VERSION = "6.0.0"
# SAELens's metadata fields (SAEMetadata); we write only these, since SAELens rejects unknown ones.
METADATA_KEYS = (
    "model_name",
    "hook_name",
    "model_class_name",
    "hook_layer",
    "hook_head_index",
    "model_from_pretrained_kwargs",
    "prepend_bos",
    "exclude_special_tokens",
    "neuronpedia_id",
    "context_size",
    "seqpos_slice",
    "dataset_path",
    "sae_lens_version",
    "sae_lens_training_version",
)
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """The canonical name ('float32', ...) of an SAE dtype; a clear error for others."""
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unsupported SAE dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return name


@dataclass
class SAEConfig:
    """Shapes and semantics of an SAE; `k` is required for TopK, `hook_name` says where it reads."""

    d_in: int
    d_sae: int
    architecture: str = "topk"
    k: Optional[int] = None
    hook_name: Optional[str] = None
    model_name: Optional[str] = None
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False  # SAELens TopK option: latents act on unit-normed rows
    dtype: str = "float32"
    metadata: Dict[str, Any] = field(default_factory=dict)  # further SAELens metadata, kept on save

    def __post_init__(self) -> None:
        self.dtype = dtype_name(self.dtype)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported SAE architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        if self.d_in < 1 or self.d_sae < 1:
            raise ValueError(f"SAE widths must be positive, got d_in={self.d_in}, d_sae={self.d_sae}")
        if self.architecture == "topk":
            if self.k is None or not 1 <= int(self.k) <= self.d_sae:
                raise ValueError(f"a TopK SAE needs 1 <= k <= d_sae={self.d_sae}, got k={self.k}")
            self.k = int(self.k)

    def to_saelens_dict(self) -> Dict[str, Any]:
        """cfg.json contents in SAELens's (>= 6.0) format."""
        meta = {k: v for k, v in self.metadata.items() if k in METADATA_KEYS}
        meta.update(model_name=self.model_name, hook_name=self.hook_name)
        meta.setdefault("hook_head_index", None)
        meta.setdefault("prepend_bos", True)
        meta.setdefault("sae_lens_version", SAELENS_FORMAT_VERSION)
        meta.setdefault("sae_lens_training_version", SAELENS_FORMAT_VERSION)
        out: Dict[str, Any] = {
            "architecture": self.architecture,
            "d_in": self.d_in,
            "d_sae": self.d_sae,
            "dtype": self.dtype,
            "device": "cpu",
            "apply_b_dec_to_input": self.apply_b_dec_to_input,
            "normalize_activations": "none",
            "reshape_activations": "none",
        }
        if self.architecture == "topk":
            out["k"] = self.k
            out["rescale_acts_by_decoder_norm"] = self.rescale_acts_by_decoder_norm
        out["metadata"] = meta
        return out


def parse_saelens_config(raw: Dict[str, Any], source: str) -> Tuple[SAEConfig, str]:
    """SAEConfig and the activation-normalisation mode from any SAELens cfg.json (pre-6 or >= 6)."""
    meta = dict(raw.get("metadata") or raw.get("meta") or {})
    hook_name = meta.get("hook_name") or raw.get("hook_name") or raw.get("hook_point")
    model_name = meta.get("model_name") or raw.get("model_name")
    architecture = raw.get("architecture", "standard")
    activation = raw.get("activation_fn") or raw.get("activation_fn_str") or "relu"
    k = raw.get("k")
    if architecture == "standard" and activation == "topk":  # SAELens < 6 stored TopK this way
        architecture = "topk"
        k = (raw.get("activation_fn_kwargs") or {}).get("k", k)
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{source}: SAE architecture {architecture!r} is not supported; reward-lens loads "
            f"{', '.join(ARCHITECTURES)} SAEs (SAELens saves BatchTopK SAEs as jumprelu for inference)"
        )
    if raw.get("reshape_activations", "none") not in ("none", None):
        raise ValueError(
            f"{source}: reshape_activations={raw['reshape_activations']!r} (hook_z SAEs) is not supported"
        )
    if raw.get("hook_head_index", meta.get("hook_head_index")) is not None:
        raise ValueError(f"{source}: per-head SAEs (hook_head_index set) are not supported")
    norm = raw.get("normalize_activations", "none")
    if norm is None or norm is False:
        norm = "none"
    elif norm is True:
        norm = "expected_average_only_in"
    if "d_in" not in raw or "d_sae" not in raw:
        raise ValueError(f"{source}: cfg.json lacks d_in/d_sae; is this an SAELens SAE directory?")
    metadata = {key: meta[key] for key in meta if key in METADATA_KEYS}
    for key in METADATA_KEYS:  # pre-6 files keep metadata at the top level
        if key in raw and key not in metadata:
            metadata[key] = raw[key]
    cfg = SAEConfig(
        d_in=int(raw["d_in"]),
        d_sae=int(raw["d_sae"]),
        architecture=architecture,
        k=k,
        hook_name=hook_name,
        model_name=model_name,
        apply_b_dec_to_input=bool(raw.get("apply_b_dec_to_input", True)),
        rescale_acts_by_decoder_norm=bool(raw.get("rescale_acts_by_decoder_norm", False)),
        dtype=dtype_name(raw.get("dtype", "float32") or "float32"),
        metadata=metadata,
    )
    return cfg, norm


def read_saelens(
    path: Union[str, Path],
    *,
    hook_name: Optional[str] = None,
    dtype: Union[str, torch.dtype, None] = None,
    norm_scaling_factor: Optional[float] = None,
) -> Tuple[SAEConfig, Dict[str, torch.Tensor]]:
    """(config, float32 weights) from an SAE directory in SAELens's format (any version), with older
    versions' scaling factors and a dataset norm factor folded into the weights."""
    directory = Path(path).expanduser()
    cfg_file = directory / SAE_CFG_FILENAME
    weights_file = directory / SAE_WEIGHTS_FILENAME
    if not cfg_file.exists() or not weights_file.exists():
        raise FileNotFoundError(
            f"{str(directory)!r} is not an SAE directory: expected {SAE_CFG_FILENAME} and "
            f"{SAE_WEIGHTS_FILENAME} (SAELens's format; save one with sae.save(path))"
        )
    raw = read_json(cfg_file)
    cfg, norm = parse_saelens_config(raw, str(directory))
    if hook_name is not None:
        cfg.hook_name = hook_name
    if dtype is not None:
        cfg.dtype = dtype_name(dtype)
    sd = {k: v.float() for k, v in load_safetensors(weights_file).items()}
    if cfg.architecture == "jumprelu" and "threshold" not in sd:
        if "log_threshold" not in sd:
            raise ValueError(f"{directory}: a jumprelu SAE needs a 'threshold' (or 'log_threshold') tensor")
        sd["threshold"] = sd.pop("log_threshold").exp()
    for name in ("scaling_factor", "finetuning_scaling_factor"):  # SAELens < 6: f * s @ W_dec
        s = sd.pop(name, None)
        if s is not None and not torch.allclose(s, torch.ones_like(s)):
            sd["W_dec"] = sd["W_dec"] * s[:, None]
    expected = {
        "W_enc": (cfg.d_in, cfg.d_sae),
        "W_dec": (cfg.d_sae, cfg.d_in),
        "b_enc": (cfg.d_sae,),
        "b_dec": (cfg.d_in,),
    }
    if cfg.architecture == "jumprelu":
        expected["threshold"] = (cfg.d_sae,)
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"{directory}: {SAE_WEIGHTS_FILENAME} lacks {name!r} (has {sorted(sd)})")
        if tuple(sd[name].shape) != shape:
            raise ValueError(
                f"{directory}: {name} has shape {tuple(sd[name].shape)}, cfg.json implies {shape}"
            )
    check_finite_weights(((k, sd[k]) for k in expected), str(weights_file))
    if norm == "expected_average_only_in":
        if norm_scaling_factor is None:
            raise ValueError(
                f"{directory}: this SAE expects inputs rescaled by a dataset norm factor "
                "(normalize_activations='expected_average_only_in'); pass load_sae(..., "
                "norm_scaling_factor=...)"
            )
        c = float(norm_scaling_factor)  # SAE(c·x)/c, folded: W_enc·c, b_dec/c, W_dec/c
        sd["W_enc"], sd["W_dec"], sd["b_dec"] = sd["W_enc"] * c, sd["W_dec"] / c, sd["b_dec"] / c
    elif norm != "none":
        raise ValueError(
            f"{directory}: normalize_activations={norm!r} makes the decoder depend on each input's norm, "
            "so the reconstruction is not a fixed sum of decoder rows; reward-lens supports 'none' and "
            "'expected_average_only_in'"
        )
    return cfg, {name: sd[name] for name in expected}


def read_extras(path: Union[str, Path], d_sae: int) -> Tuple[Optional[torch.Tensor], Dict[str, Any]]:
    """(firing frequency [d_sae] from sparsity.safetensors or None, our training record or {})."""
    directory = Path(path).expanduser()
    freq = None
    sparsity = directory / SPARSITY_FILENAME
    if sparsity.exists():
        log_freq = load_safetensors(sparsity).get("sparsity")
        if log_freq is not None and log_freq.shape == (d_sae,):
            freq = (10.0 ** log_freq.float()).clamp(max=1.0)
            freq[freq < 1e-9] = 0.0
    training = directory / TRAINING_FILENAME
    info = read_json(training) if training.exists() else {}  # damaged: one line naming the file
    return freq, info


def write_saelens(
    path: Union[str, Path],
    cfg: SAEConfig,
    weights: Dict[str, torch.Tensor],
    *,
    firing_frequency: Optional[torch.Tensor] = None,
    info: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write SAELens's format: cfg.json + sae_weights.safetensors (+ sparsity.safetensors, + our record)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SAE_CFG_FILENAME).write_text(json.dumps(cfg.to_saelens_dict(), indent=1))
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(path / SAE_WEIGHTS_FILENAME)
    )
    if firing_frequency is not None:
        log_freq = torch.log10(firing_frequency.float() + 1e-10)
        save_file({"sparsity": log_freq.contiguous()}, str(path / SPARSITY_FILENAME))
    if info:
        (path / TRAINING_FILENAME).write_text(json.dumps(info, indent=1, default=str))
    return path
