"""Sparse autoencoders on reward-model activations: the module (this file), SAELens's disk format
(`saelens.py`) and TopK training (`train.py`).

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

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
import torch.nn as nn
from jaxtyping import Float

from reward_lens.model import hooks
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.representations.sae.saelens import (
    DTYPES,
    SAEConfig,
    read_extras,
    read_saelens,
    write_saelens,
)

__all__ = ["SAEConfig", "SAEMetrics", "SparseAutoencoder", "hook_width", "load_sae"]


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
        """One row: fvu, l0, dead_fraction, n_tokens (the training curves are `history`)."""
        import pandas as pd

        return pd.DataFrame(
            [{"fvu": self.fvu, "l0": self.l0, "dead_fraction": self.dead_fraction, "n_tokens": self.n_tokens}]
        )

    def summary(self):
        """The same one row as `to_frame()`: the metrics are already a summary."""
        return self.to_frame()

    def plot(self, ax=None):
        """Training curves (FVU and dead fraction per step; two panels) when known, else the firing-frequency
        histogram (one panel)."""
        curves = self.history is not None and len(self.history)
        created = ax is None
        fig, axes = panels(ax, 2 if curves else 1, (8, 3.2))
        if curves:
            ax1, ax2 = axes
            ax1.plot(self.history["step"], self.history["fvu"], label="FVU (batch)")
            ax1.set_yscale("log")
            ax1.set_xlabel("step")
            ax1.set_ylabel("FVU")
            ax2.plot(self.history["step"], self.history["dead_fraction"], color="C3")
            ax2.set_xlabel("step")
            ax2.set_ylabel("dead fraction")
        else:
            ax = axes[0]
            freq = self.firing_frequency.clamp(min=1e-8).log10().numpy()
            ax.hist(freq, bins=50)
            ax.set_xlabel("log10 firing frequency")
            ax.set_ylabel("latents")
        axes[0].set_title(
            f"FVU {self.fvu:.3f} · L0 {self.l0:.1f} · dead {self.dead_fraction:.1%}", fontsize=9
        )
        return finish(fig, created)


class SparseAutoencoder(nn.Module):
    """An SAE with SAELens's parameter names and shapes: `W_enc [d_in, d_sae]`, `W_dec [d_sae, d_in]`,
    `b_enc [d_sae]`, `b_dec [d_in]` (+ `threshold [d_sae]` for JumpReLU)."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        dtype = DTYPES[cfg.dtype]
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
            raise ValueError(
                "this SAE records no hook_name; pass hook_name='blocks.L.hook_resid_post' (where it was "
                "trained)"
            )
        if hook_name not in model.hook_dict:
            raise ValueError(
                f"the model has no hook {hook_name!r}; SAEs read hooks such as 'blocks.0.hook_resid_post'"
            )
        width = hooks.hook_width(model.cfg, hook_name)
        if width is not None and width != self.cfg.d_in:
            raise ValueError(
                f"SAE width d_in={self.cfg.d_in} does not match {hook_name} on this model (width {width}, "
                f"d_model={model.cfg.d_model}); this SAE was trained on a different model or hook"
            )
        return hook_name

    # ------------------------------------------------------------------ metrics
    @checked_arguments(counts={"batch_size": 1})
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
            fvu=sse / max(sst, 1e-30),
            l0=l0 / max(n, 1),
            dead_fraction=float((fired == 0).double().mean()),
            n_tokens=n,
            firing_frequency=(fired / max(n, 1)).float(),
        )

    # ------------------------------------------------------------------ disk
    def save(self, path: Union[str, Path]) -> Path:
        """Write SAELens's format: cfg.json + sae_weights.safetensors (+ sparsity.safetensors)."""
        weights = {"W_enc": self.W_enc, "W_dec": self.W_dec, "b_enc": self.b_enc, "b_dec": self.b_dec}
        if self.cfg.architecture == "jumprelu":
            weights["threshold"] = self.threshold
        info = {}
        if self.training_config or self.metrics is not None:
            info = {"training": self.training_config}
            if self.metrics is not None:
                info["metrics"] = {
                    k: v for k, v in asdict(self.metrics).items() if isinstance(v, (int, float))
                }
        freq = self.metrics.firing_frequency if self.metrics is not None else None
        return write_saelens(path, self.cfg, weights, firing_frequency=freq, info=info)

    @classmethod
    def load(cls, path: Union[str, Path], **kwargs: Any) -> "SparseAutoencoder":
        return load_sae(path, **kwargs)

    def __repr__(self) -> str:
        c = self.cfg
        k = f", k={c.k}" if c.architecture == "topk" else ""
        return f"SparseAutoencoder({c.architecture}, d_in={c.d_in}, d_sae={c.d_sae}{k}, hook={c.hook_name!r})"


def hook_width(model, hook_name: str) -> Optional[int]:
    """The last-axis width of a hook's activation on `model` when it is one vector per token (else None)."""
    return hooks.hook_width(model.cfg, hook_name)


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
    cfg, weights = read_saelens(
        path, hook_name=hook_name, dtype=dtype, norm_scaling_factor=norm_scaling_factor
    )
    sae = SparseAutoencoder(cfg)
    with torch.no_grad():
        for name, value in weights.items():
            getattr(sae, name).copy_(value.to(DTYPES[cfg.dtype]))
    freq, info = read_extras(path, cfg.d_sae)
    if freq is not None:
        sae.metrics = SAEMetrics(float("nan"), float("nan"), float((freq == 0).float().mean()), 0, freq)
    sae.training_config = info.get("training", {})
    if sae.metrics is not None and "metrics" in info:
        m = info["metrics"]
        sae.metrics.fvu, sae.metrics.l0 = m.get("fvu", float("nan")), m.get("l0", float("nan"))
        sae.metrics.dead_fraction, sae.metrics.n_tokens = (
            m.get("dead_fraction", sae.metrics.dead_fraction),
            m.get("n_tokens", 0),
        )
    if device is not None:
        sae.to(device)
    if model is not None:
        sae.check_hook(model)
    return sae
