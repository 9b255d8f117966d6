"""Sparse autoencoders on reward-model activations: TopK training and SAELens's disk format.

An SAE maps an activation x [d_in] to sparse latents f [d_sae] and back:

    encode: pre = (x - b_dec·[apply_b_dec_to_input]) @ W_enc + b_enc
            topk:     keep the k largest entries of pre, ReLU them, zero the rest
            standard: relu(pre)
            jumprelu: relu(pre) · [pre > threshold]
    decode: x̂ = f @ W_dec + b_dec

so x = Σ_i f_i d_i + b_dec + (x - x̂) with d_i the i-th decoder row: exactly what feature attribution
along the reward direction decomposes (`reward_lens.representations.features`).

Disk format (SAELens ≥ 6): a directory with `cfg.json` (`architecture`, `d_in`, `d_sae`, `k`,
`apply_b_dec_to_input`, `normalize_activations`, `metadata.hook_name`, ...) and
`sae_weights.safetensors` (`W_enc [d_in, d_sae]`, `W_dec [d_sae, d_in]`, `b_enc [d_sae]`,
`b_dec [d_in]`, and `threshold [d_sae]` for JumpReLU). `load_sae` also reads directories written by
older SAELens versions (flat `hook_name`/`hook_point`, TopK stored as `activation_fn_str="topk"`,
`scaling_factor`/`log_threshold` tensors) without needing sae_lens installed.

Training (`train_sae`) follows Gao et al. 2024 ("Scaling and evaluating sparse autoencoders"): TopK
activation, decoder rows kept at unit norm (and their gradient's radial part removed), b_dec initialised
at the data mean, inputs rescaled to unit mean squared norm per dimension during training (folded back
at the end, so the saved SAE acts on raw activations), and the AuxK loss: the top `aux_k` *dead* latents
(no firing for `dead_after` tokens) reconstruct the main reconstruction's error, weighted `aux_coef`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from jaxtyping import Float

from reward_lens.model import hooks

SAE_CFG_FILENAME = "cfg.json"
SAE_WEIGHTS_FILENAME = "sae_weights.safetensors"
SPARSITY_FILENAME = "sparsity.safetensors"  # SAELens's optional log10 firing-frequency file
TRAINING_FILENAME = "reward_lens_training.json"  # ours: hyperparameters and metrics (SAELens ignores it)
ARCHITECTURES = ("topk", "standard", "jumprelu")
# The SAELens config-format version our cfg.json follows; SAELens treats files without one as pre-6.0.
SAELENS_FORMAT_VERSION = "6.0.0"
# SAELens's metadata fields (SAEMetadata); we write only these, since SAELens rejects unknown ones.
_METADATA_KEYS = (
    "model_name", "hook_name", "model_class_name", "hook_layer", "hook_head_index",
    "model_from_pretrained_kwargs", "prepend_bos", "exclude_special_tokens", "neuronpedia_id",
    "context_size", "seqpos_slice", "dataset_path", "sae_lens_version", "sae_lens_training_version",
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}

# Hook suffixes whose activation is d_model wide (residual-stream-like) or d_mlp wide.
def _dtype_name(dtype: Union[str, torch.dtype]) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unsupported SAE dtype {dtype!r}; use one of {sorted(_DTYPES)}")
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
        self.dtype = _dtype_name(self.dtype)
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported SAE architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.d_in < 1 or self.d_sae < 1:
            raise ValueError(f"SAE widths must be positive, got d_in={self.d_in}, d_sae={self.d_sae}")
        if self.architecture == "topk":
            if self.k is None or not 1 <= int(self.k) <= self.d_sae:
                raise ValueError(f"a TopK SAE needs 1 <= k <= d_sae={self.d_sae}, got k={self.k}")
            self.k = int(self.k)

    def to_saelens_dict(self) -> Dict[str, Any]:
        """cfg.json contents in SAELens's (>= 6.0) format."""
        meta = {k: v for k, v in self.metadata.items() if k in _METADATA_KEYS}
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


def _parse_saelens_config(raw: Dict[str, Any], source: str) -> Tuple[SAEConfig, str]:
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
        raise ValueError(f"{source}: reshape_activations={raw['reshape_activations']!r} (hook_z SAEs) is not supported")
    if raw.get("hook_head_index", meta.get("hook_head_index")) is not None:
        raise ValueError(f"{source}: per-head SAEs (hook_head_index set) are not supported")
    norm = raw.get("normalize_activations", "none")
    if norm is None or norm is False:
        norm = "none"
    elif norm is True:
        norm = "expected_average_only_in"
    if "d_in" not in raw or "d_sae" not in raw:
        raise ValueError(f"{source}: cfg.json lacks d_in/d_sae; is this an SAELens SAE directory?")
    metadata = {key: meta[key] for key in meta if key in _METADATA_KEYS}
    for key in _METADATA_KEYS:  # pre-6 files keep metadata at the top level
        if key in raw and key not in metadata:
            metadata[key] = raw[key]
    cfg = SAEConfig(
        d_in=int(raw["d_in"]), d_sae=int(raw["d_sae"]), architecture=architecture, k=k,
        hook_name=hook_name, model_name=model_name,
        apply_b_dec_to_input=bool(raw.get("apply_b_dec_to_input", True)),
        rescale_acts_by_decoder_norm=bool(raw.get("rescale_acts_by_decoder_norm", False)),
        dtype=_dtype_name(raw.get("dtype", "float32") or "float32"), metadata=metadata,
    )
    return cfg, norm


@dataclass
class SAEMetrics:
    """How well an SAE reconstructs a set of activations.

    fvu: fraction of variance unexplained, Σ‖x − x̂‖² / Σ‖x − mean(x)‖²; l0: mean number of active
    latents per token; dead_fraction: latents that never fired on these tokens (during training: none
    in the last `dead_after` training tokens, see `history`).
    """

    fvu: float
    l0: float
    dead_fraction: float
    n_tokens: int
    firing_frequency: torch.Tensor  # [d_sae] fraction of tokens on which each latent fired
    history: Optional[Any] = None  # pandas DataFrame of training curves (step, fvu, aux_loss, dead_fraction)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([{"fvu": self.fvu, "l0": self.l0, "dead_fraction": self.dead_fraction, "n_tokens": self.n_tokens}])

    def plot(self):
        """Training curves (FVU and dead fraction per step) when known, else the firing-frequency histogram."""
        import matplotlib.figure

        fig = matplotlib.figure.Figure(figsize=(8, 3.2))
        if self.history is not None and len(self.history):
            ax1, ax2 = fig.subplots(1, 2)
            ax1.plot(self.history["step"], self.history["fvu"], label="FVU (batch)")
            ax1.set_yscale("log")
            ax1.set_xlabel("step")
            ax1.set_ylabel("FVU")
            ax2.plot(self.history["step"], self.history["dead_fraction"], color="C3")
            ax2.set_xlabel("step")
            ax2.set_ylabel("dead fraction")
        else:
            ax = fig.subplots()
            freq = self.firing_frequency.clamp(min=1e-8).log10().numpy()
            ax.hist(freq, bins=50)
            ax.set_xlabel("log10 firing frequency")
            ax.set_ylabel("latents")
        fig.suptitle(f"FVU {self.fvu:.3f} · L0 {self.l0:.1f} · dead {self.dead_fraction:.1%}")
        fig.tight_layout()
        return fig


class SparseAutoencoder(nn.Module):
    """An SAE with SAELens's parameter names and shapes: `W_enc [d_in, d_sae]`, `W_dec [d_sae, d_in]`,
    `b_enc [d_sae]`, `b_dec [d_in]` (+ `threshold [d_sae]` for JumpReLU)."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        dtype = _DTYPES[cfg.dtype]
        self.W_enc = nn.Parameter(torch.zeros(cfg.d_in, cfg.d_sae, dtype=dtype))
        self.W_dec = nn.Parameter(torch.zeros(cfg.d_sae, cfg.d_in, dtype=dtype))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_in, dtype=dtype))
        if cfg.architecture == "jumprelu":
            self.threshold = nn.Parameter(torch.zeros(cfg.d_sae, dtype=dtype))
        self.metrics: Optional[SAEMetrics] = None
        self.training_config: Dict[str, Any] = {}
        self.requires_grad_(False)

    # ------------------------------------------------------------------ the map
    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.W_enc.dtype)
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.cfg.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def _activate(self, pre: torch.Tensor) -> torch.Tensor:
        arch = self.cfg.architecture
        if arch == "topk":
            values, indices = pre.topk(self.cfg.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        if arch == "jumprelu":
            return pre.relu() * (pre > self.threshold)
        return pre.relu()

    def encode(self, x: Float[torch.Tensor, "... d_in"]) -> Float[torch.Tensor, "... d_sae"]:
        """Latent activations f (non-negative; at most k non-zero per row for TopK)."""
        self._check_width(x)
        return self._activate(self._pre(x))

    def decode(self, f: Float[torch.Tensor, "... d_sae"]) -> Float[torch.Tensor, "... d_in"]:
        """x̂ = f @ W_dec + b_dec (rows rescaled to unit norm first when the SAE was trained so)."""
        return f.to(self.W_dec.dtype) @ self.decoder_directions + self.b_dec

    def forward(self, x: Float[torch.Tensor, "... d_in"]) -> Float[torch.Tensor, "... d_in"]:
        return self.decode(self.encode(x))

    @property
    def decoder_directions(self) -> Float[torch.Tensor, "d_sae d_in"]:
        """d_i: what one unit of latent i adds to the reconstruction (W_dec, or its unit-normed rows)."""
        if self.cfg.rescale_acts_by_decoder_norm:
            return self.W_dec / self.W_dec.norm(dim=-1, keepdim=True)
        return self.W_dec

    def _check_width(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.cfg.d_in:
            where = f" (trained on {self.cfg.hook_name})" if self.cfg.hook_name else ""
            raise ValueError(
                f"activation width {x.shape[-1]} does not match this SAE's d_in={self.cfg.d_in}{where}; "
                "use an SAE trained on this model's hook"
            )

    # ------------------------------------------------------------------ model checks
    def check_hook(self, model, hook_name: Optional[str] = None) -> str:
        """The hook this SAE reads on `model`; a clear error when it does not exist or its width differs."""
        hook_name = hook_name or self.cfg.hook_name
        if not hook_name:
            raise ValueError("this SAE records no hook_name; pass hook_name='blocks.L.hook_resid_post' (where it was trained)")
        if hook_name not in model.hook_dict:
            raise ValueError(f"the model has no hook {hook_name!r}; SAEs read hooks such as 'blocks.0.hook_resid_post'")
        width = hooks.hook_width(model.cfg, hook_name)
        if width is not None and width != self.cfg.d_in:
            raise ValueError(
                f"SAE width d_in={self.cfg.d_in} does not match {hook_name} on this model (width {width}, "
                f"d_model={model.cfg.d_model}); this SAE was trained on a different model or hook"
            )
        return hook_name

    # ------------------------------------------------------------------ metrics
    @torch.no_grad()
    def evaluate(self, x: Float[torch.Tensor, "n d_in"], batch_size: int = 4096) -> SAEMetrics:
        """FVU, L0 and dead fraction on activations x (any leading shape, flattened)."""
        x = x.reshape(-1, x.shape[-1])
        self._check_width(x)
        mean = x.double().mean(0)
        sse, sst, l0 = 0.0, 0.0, 0.0
        fired = torch.zeros(self.cfg.d_sae, dtype=torch.float64)
        for s in range(0, x.shape[0], batch_size):
            xb = x[s : s + batch_size].to(self.W_enc.device)
            f = self.encode(xb)
            err = (xb.to(f.dtype) - self.decode(f)).double()
            sse += float(err.pow(2).sum())
            sst += float((xb.double() - mean.to(xb.device)).pow(2).sum())
            active = f > 0
            l0 += float(active.sum())
            fired += active.sum(0).double().cpu()
        n = x.shape[0]
        return SAEMetrics(
            fvu=sse / max(sst, 1e-30), l0=l0 / max(n, 1), dead_fraction=float((fired == 0).double().mean()),
            n_tokens=n, firing_frequency=(fired / max(n, 1)).float(),
        )

    # ------------------------------------------------------------------ disk
    def save(self, path: Union[str, Path]) -> Path:
        """Write SAELens's format: cfg.json + sae_weights.safetensors (+ sparsity.safetensors)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / SAE_CFG_FILENAME).write_text(json.dumps(self.cfg.to_saelens_dict(), indent=1))
        weights = {"W_enc": self.W_enc, "W_dec": self.W_dec, "b_enc": self.b_enc, "b_dec": self.b_dec}
        if self.cfg.architecture == "jumprelu":
            weights["threshold"] = self.threshold
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(path / SAE_WEIGHTS_FILENAME))
        if self.metrics is not None:
            log_freq = torch.log10(self.metrics.firing_frequency.float() + 1e-10)
            save_file({"sparsity": log_freq.contiguous()}, str(path / SPARSITY_FILENAME))
        if self.training_config or self.metrics is not None:
            info = {"training": self.training_config}
            if self.metrics is not None:
                info["metrics"] = {k: v for k, v in asdict(self.metrics).items() if isinstance(v, (int, float))}
            (path / TRAINING_FILENAME).write_text(json.dumps(info, indent=1, default=str))
        return path

    @classmethod
    def load(cls, path: Union[str, Path], **kwargs: Any) -> "SparseAutoencoder":
        return load_sae(path, **kwargs)

    def __repr__(self) -> str:
        c = self.cfg
        k = f", k={c.k}" if c.architecture == "topk" else ""
        return f"SparseAutoencoder({c.architecture}, d_in={c.d_in}, d_sae={c.d_sae}{k}, hook={c.hook_name!r})"


# ---------------------------------------------------------------------------------------------- loading
def load_sae(
    path: Union[str, Path],
    *,
    model=None,
    hook_name: Optional[str] = None,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    norm_scaling_factor: Optional[float] = None,
) -> SparseAutoencoder:
    """Load an SAE directory in SAELens's format (saved by reward-lens or by SAELens: standard, topk,
    jumprelu), without sae_lens installed.

    `model` (optional) checks that the SAE's width matches its hook on that model; `hook_name` overrides
    the recorded hook. SAEs trained with `normalize_activations="expected_average_only_in"` need the
    dataset's `norm_scaling_factor` (SAELens keeps it outside the directory); it is folded into the weights.
    """
    from safetensors.torch import load_file

    directory = Path(path).expanduser()
    cfg_file = directory / SAE_CFG_FILENAME
    weights_file = directory / SAE_WEIGHTS_FILENAME
    if not cfg_file.exists() or not weights_file.exists():
        raise FileNotFoundError(
            f"{str(directory)!r} is not an SAE directory: expected {SAE_CFG_FILENAME} and {SAE_WEIGHTS_FILENAME} "
            "(SAELens's format; save one with sae.save(path))"
        )
    raw = json.loads(cfg_file.read_text())
    cfg, norm = _parse_saelens_config(raw, str(directory))
    if hook_name is not None:
        cfg.hook_name = hook_name
    if dtype is not None:
        cfg.dtype = _dtype_name(dtype)
    sd = {k: v.float() for k, v in load_file(str(weights_file)).items()}
    if cfg.architecture == "jumprelu" and "threshold" not in sd:
        if "log_threshold" not in sd:
            raise ValueError(f"{directory}: a jumprelu SAE needs a 'threshold' (or 'log_threshold') tensor")
        sd["threshold"] = sd.pop("log_threshold").exp()
    for name in ("scaling_factor", "finetuning_scaling_factor"):  # SAELens < 6: f * s @ W_dec
        s = sd.pop(name, None)
        if s is not None and not torch.allclose(s, torch.ones_like(s)):
            sd["W_dec"] = sd["W_dec"] * s[:, None]
    expected = {
        "W_enc": (cfg.d_in, cfg.d_sae), "W_dec": (cfg.d_sae, cfg.d_in), "b_enc": (cfg.d_sae,), "b_dec": (cfg.d_in,),
    }
    if cfg.architecture == "jumprelu":
        expected["threshold"] = (cfg.d_sae,)
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"{directory}: {SAE_WEIGHTS_FILENAME} lacks {name!r} (has {sorted(sd)})")
        if tuple(sd[name].shape) != shape:
            raise ValueError(f"{directory}: {name} has shape {tuple(sd[name].shape)}, cfg.json implies {shape}")
    if norm == "expected_average_only_in":
        if norm_scaling_factor is None:
            raise ValueError(
                f"{directory}: this SAE expects inputs rescaled by a dataset norm factor "
                "(normalize_activations='expected_average_only_in'); pass load_sae(..., norm_scaling_factor=...)"
            )
        c = float(norm_scaling_factor)  # SAE(c·x)/c, folded: W_enc·c, b_dec/c, W_dec/c
        sd["W_enc"], sd["W_dec"], sd["b_dec"] = sd["W_enc"] * c, sd["W_dec"] / c, sd["b_dec"] / c
    elif norm != "none":
        raise ValueError(
            f"{directory}: normalize_activations={norm!r} makes the decoder depend on each input's norm, so the "
            "reconstruction is not a fixed sum of decoder rows; reward-lens supports 'none' and 'expected_average_only_in'"
        )
    sae = SparseAutoencoder(cfg)
    with torch.no_grad():
        for name in expected:
            getattr(sae, name).copy_(sd[name].to(_DTYPES[cfg.dtype]))
    sparsity = directory / SPARSITY_FILENAME
    if sparsity.exists():
        log_freq = load_file(str(sparsity)).get("sparsity")
        if log_freq is not None and log_freq.shape == (cfg.d_sae,):
            freq = (10.0 ** log_freq.float()).clamp(max=1.0)
            freq[freq < 1e-9] = 0.0
            sae.metrics = SAEMetrics(float("nan"), float("nan"), float((freq == 0).float().mean()), 0, freq)
    training = directory / TRAINING_FILENAME
    if training.exists():
        info = json.loads(training.read_text())
        sae.training_config = info.get("training", {})
        if sae.metrics is not None and "metrics" in info:
            m = info["metrics"]
            sae.metrics.fvu, sae.metrics.l0 = m.get("fvu", float("nan")), m.get("l0", float("nan"))
            sae.metrics.dead_fraction, sae.metrics.n_tokens = m.get("dead_fraction", sae.metrics.dead_fraction), m.get("n_tokens", 0)
    if device is not None:
        sae.to(device)
    if model is not None:
        sae.check_hook(model)
    return sae


# ---------------------------------------------------------------------------------------------- training
def _pair_texts(data: Sequence[Any]) -> Tuple[List[str], List[str]]:
    """(prompts, responses) of every response in preference pairs or contrast pairs."""
    prompts: List[str] = []
    responses: List[str] = []
    for item in data:
        sides = ("chosen", "rejected") if hasattr(item, "chosen") else ("positive", "negative")
        if not hasattr(item, "prompt") or not all(hasattr(item, s) for s in sides):
            raise ValueError(
                f"cannot read texts from {type(item).__name__}; pass PreferencePairs, ContrastPairs, "
                "(prompts, responses), a token dict, or an activation tensor [n, d_in]"
            )
        for side in sides:
            prompts.append(item.prompt)
            responses.append(getattr(item, side))
    return prompts, responses


def gather_activations(
    model,
    data: Any,
    hook_name: str,
    *,
    positions: str = "all",
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    progress: Union[bool, str] = False,
) -> torch.Tensor:
    """Activations [n, width] at `hook_name` for texts (pairs, (prompts, responses)) or token ids, on CPU."""
    from reward_lens.core.readout import stream_activations

    kwargs: Dict[str, Any] = dict(positions=positions, batch_size=batch_size, progress=progress, device="cpu")
    if isinstance(data, dict):
        if "input_ids" not in data:
            raise ValueError("a token dict needs 'input_ids' (and optionally 'attention_mask')")
        stream = stream_activations(model, hook_name=hook_name, input_ids=data["input_ids"],
                                    attention_mask=data.get("attention_mask"), **kwargs)
    elif isinstance(data, torch.Tensor) and not data.is_floating_point():
        mask = None if model.cfg.pad_token_id is None else (data != model.cfg.pad_token_id).long()
        stream = stream_activations(model, hook_name=hook_name, input_ids=data, attention_mask=mask, **kwargs)
    else:
        if isinstance(data, tuple) and len(data) == 2 and all(isinstance(d, (list, tuple)) for d in data) and (
            not data[0] or isinstance(data[0][0], str)
        ):
            prompts, responses = list(data[0]), list(data[1])
        else:
            prompts, responses = _pair_texts(list(data))
        stream = stream_activations(model, prompts, responses, hook_name, **kwargs)
    chunks: List[torch.Tensor] = []
    total = 0
    for chunk in stream:
        chunks.append(chunk.float())
        total += chunk.shape[0]
        if max_tokens is not None and total >= max_tokens:
            break
    if not chunks:
        raise ValueError("no activations gathered: the data is empty")
    acts = torch.cat(chunks)
    return acts[:max_tokens] if max_tokens is not None else acts


def topk_losses(
    params: Dict[str, torch.Tensor], x: torch.Tensor, k: int, dead: Optional[torch.Tensor], aux_k: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reconstruction loss, AuxK loss, [d_sae] which latents fired) of a TopK SAE on inputs x scaled so that E‖x − μ‖² = d_in (both are
    then FVU-like). AuxK (Gao et al. 2024): the top `aux_k` pre-activations among `dead` latents, un-ReLU'd
    so that latents whose inputs all fall below zero still get a gradient, reconstruct the detached error."""
    d_in = x.shape[-1]
    W_enc, W_dec, b_enc, b_dec = params["W_enc"], params["W_dec"], params["b_enc"], params["b_dec"]
    pre = (x - b_dec) @ W_enc + b_enc
    values, indices = pre.topk(k, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, indices, values.relu())
    err = x - (f @ W_dec + b_dec)
    mse = err.pow(2).sum(-1).mean() / d_in
    aux = torch.zeros((), device=x.device)
    n_dead = 0 if dead is None else int(dead.sum())
    if n_dead:
        ka = min(aux_k, n_dead)
        aux_values, aux_idx = pre.masked_fill(~dead, float("-inf")).topk(ka, dim=-1)
        f_aux = torch.zeros_like(pre).scatter(-1, aux_idx, aux_values)
        aux = (err.detach() - f_aux @ W_dec).pow(2).sum(-1).mean() / d_in
    return mse, aux, (f > 0).any(0).detach()


def train_sae(
    model=None,
    data: Any = None,
    *,
    hook_name: Optional[str] = None,
    layer: Optional[int] = None,
    positions: str = "all",
    d_sae: Optional[int] = None,
    expansion: int = 8,
    k: int = 32,
    lr: Optional[float] = None,
    batch_size: int = 4096,
    epochs: float = 10.0,
    steps: Optional[int] = None,
    aux_k: Optional[int] = None,
    aux_coef: float = 1.0 / 32,
    dead_after: Optional[int] = None,
    val_fraction: float = 0.1,
    max_tokens: Optional[int] = 2_000_000,
    model_batch_size: int = 8,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
    progress: bool = True,
) -> SparseAutoencoder:
    """Train a TopK SAE on activations of `model` at `hook_name`; returns it with `.metrics` (held-out
    FVU, L0, dead fraction, training curves).

    data: PreferencePairs or ContrastPairs (every response), `(prompts, responses)`, token ids (a tensor
    or {"input_ids", "attention_mask"}), or a float tensor of activations [n, d_in] (then `model` is
    optional and only checks the width). Activations are streamed from the model once (at every non-pad
    token, or only at readout positions with `positions="readout"`), kept on CPU (at most `max_tokens`
    rows) and shuffled; `epochs` passes over them (or `steps` batches).
    hook_name defaults to `blocks.{layer}.hook_resid_post`, layer to the middle of the model.
    d_sae defaults to `expansion · d_in`; lr to 2e-4 / sqrt(d_sae / 16384) (Gao et al.'s scaling law).
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if model is not None:
        if hook_name is None:
            layer = model.cfg.n_layers // 2 if layer is None else layer
            if not 0 <= layer < model.cfg.n_layers:
                raise ValueError(f"layer {layer} out of range: the model has {model.cfg.n_layers} layers")
            hook_name = hooks.act_name("resid_post", layer)
        if hook_name not in model.hook_dict:
            raise ValueError(f"the model has no hook {hook_name!r}; e.g. 'blocks.0.hook_resid_post'")
    if data is None:
        raise ValueError("train_sae needs data: pairs, (prompts, responses), token ids, or activations [n, d_in]")
    if isinstance(data, torch.Tensor) and data.is_floating_point():
        acts = data.detach().reshape(-1, data.shape[-1]).float().cpu()
    else:
        if model is None:
            raise ValueError("training from texts or tokens needs the model to stream activations from; pass model=")
        acts = gather_activations(model, data, hook_name, positions=positions, batch_size=model_batch_size,
                                  max_tokens=max_tokens, progress="activations" if progress else False)
    if acts.dim() != 2:
        raise ValueError(
            f"{hook_name} gives {tuple(acts.shape[1:])} per token; SAEs here read one vector per token "
            "(e.g. hook_resid_post, hook_mlp_out, mlp.hook_post)"
        )
    d_in = acts.shape[-1]
    if model is not None:
        width = hooks.hook_width(model.cfg, hook_name)
        if width is not None and width != d_in:
            raise ValueError(f"activations have width {d_in} but {hook_name} on this model is {width} wide")
    n = acts.shape[0]
    if n < 2:
        raise ValueError(f"got {n} activation row(s); an SAE needs many tokens (thousands or more)")
    d_sae = int(d_sae or expansion * d_in)
    if not 1 <= k <= d_sae:
        raise ValueError(f"k must be in [1, d_sae={d_sae}], got {k}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    device = torch.device(device) if device is not None else (model.cfg.device if model is not None else torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_val = int(round(n * val_fraction)) if n >= 20 else 0
    val, train = acts[perm[:n_val]], acts[perm[n_val:]]
    n_train = train.shape[0]
    batch_size = min(batch_size, n_train)
    total_steps = int(steps) if steps is not None else max(1, math.ceil(epochs * n_train / batch_size))
    lr = lr if lr is not None else 2e-4 / math.sqrt(d_sae / 16384)
    aux_k = int(aux_k) if aux_k is not None else max(1, d_in // 2)
    dead_after = int(dead_after) if dead_after is not None else min(n_train, 10_000_000)

    # Train on mean-centred-scale-normalised inputs (E‖x − μ‖² = d_in), so lr means the same at any scale.
    X = train.to(device)
    mu = X.mean(0)
    var_per_token = float((X - mu).pow(2).sum(-1).mean())
    c = math.sqrt(d_in / max(var_per_token, 1e-30))
    X = X * c
    W_dec = torch.randn(d_sae, d_in, generator=g).to(device)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    params = {
        "W_enc": W_dec.T.clone().contiguous().requires_grad_(True),
        "W_dec": W_dec.requires_grad_(True),
        "b_enc": torch.zeros(d_sae, device=device, requires_grad=True),
        "b_dec": (mu * c).clone().requires_grad_(True),
    }
    opt = torch.optim.Adam(params.values(), lr=lr, betas=(0.9, 0.999), eps=6.25e-10)
    decay_from = int(0.8 * total_steps)
    since_fired = torch.zeros(d_sae, dtype=torch.long, device=device)
    history: List[Dict[str, float]] = []
    log_every = max(1, total_steps // 200)
    order = torch.randperm(n_train, generator=g)
    cursor = 0
    bar = tqdm(range(total_steps), desc="SAE", leave=False, disable=not progress)
    for step in bar:
        if cursor + batch_size > n_train:
            order, cursor = torch.randperm(n_train, generator=g), 0
        xb = X[order[cursor : cursor + batch_size].to(device)]
        cursor += batch_size
        dead = since_fired >= dead_after  # no firing in the last `dead_after` training tokens
        n_dead = int(dead.sum())
        mse, aux, fired = topk_losses(params, xb, k, dead if aux_coef > 0 else None, aux_k)
        with torch.no_grad():
            since_fired += xb.shape[0]
            since_fired[fired] = 0
        W_d = params["W_dec"]
        loss = mse + aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():  # keep rows unit-norm: drop the radial part of their gradient, then renormalise
            grad = W_d.grad
            grad -= (grad * W_d).sum(-1, keepdim=True) * W_d
        if step >= decay_from:
            for group in opt.param_groups:
                group["lr"] = lr * (total_steps - step) / max(1, total_steps - decay_from)
        opt.step()
        with torch.no_grad():
            W_d /= W_d.norm(dim=-1, keepdim=True)
        if step % log_every == 0 or step == total_steps - 1:
            history.append({"step": step, "fvu": float(mse.detach()), "aux_loss": float(aux.detach()), "dead_fraction": n_dead / d_sae})
            bar.set_postfix(fvu=f"{float(mse.detach()):.4f}", dead=f"{n_dead / d_sae:.1%}", refresh=False)
    bar.close()

    cfg = SAEConfig(
        d_in=d_in, d_sae=d_sae, architecture="topk", k=k, hook_name=hook_name,
        model_name=getattr(getattr(model, "cfg", None), "model_name", None),
        metadata={"context_size": None, "dataset_path": None},
    )
    sae = SparseAutoencoder(cfg).to(device)
    with torch.no_grad():  # fold the input scale c back: f_raw = f / c, biases / c, rows unchanged
        sae.W_enc.copy_(params["W_enc"])
        sae.W_dec.copy_(params["W_dec"])
        sae.b_enc.copy_(params["b_enc"] / c)
        sae.b_dec.copy_(params["b_dec"] / c)
    sae.training_config = dict(
        hook_name=hook_name, positions=positions, d_sae=d_sae, k=k, lr=lr, batch_size=batch_size, steps=total_steps,
        aux_k=aux_k, aux_coef=aux_coef, dead_after=dead_after, n_train_tokens=n_train, n_val_tokens=n_val, seed=seed,
    )
    metrics = sae.evaluate(val if n_val else train)
    metrics.history = pd.DataFrame(history)
    sae.metrics = metrics
    return sae
