"""The generic path's final norm: which norm the checkpoint's final norm is (LayerNorm or RMSNorm, with
or without a (1 + w) gain; identified by matching its output on a test input), and `GenericFinalNorm`,
that norm recomputed so its scale is a hook."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from reward_lens.model.generic.discovery import EPS_ATTRS, GenericLoadError, first_attr, text_config


def dtype_tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 3e-2


def identify_norm(norm: nn.Module, d_model: int, path: str, config: Any) -> Tuple[str, float, float]:
    """(kind "LN"/"RMS", weight offset, eps) reproducing `norm` on a test input; refuse when none does."""
    eps = first_attr(norm, EPS_ATTRS)
    if eps is None:
        eps = first_attr(
            text_config(config), ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
        )
    if eps is None:
        raise GenericLoadError(f"cannot tell the epsilon of the final norm {path} ({type(norm).__name__})")
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    param = weight if isinstance(weight, torch.Tensor) else next(norm.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, d_model, generator=g) * 3 + 0.7).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = norm(x)
        ref = (ref[0] if isinstance(ref, tuple) else ref).float()
    first = "LN" if isinstance(norm, nn.LayerNorm) or "rms" not in type(norm).__name__.lower() else "RMS"
    candidates = [(first, 0.0), ("RMS" if first == "LN" else "LN", 0.0), ("RMS", 1.0), ("LN", 1.0)]
    tol = dtype_tolerance(dtype) * max(1.0, ref.abs().max().item())
    errors = []
    for kind, offset in candidates:
        with torch.no_grad():
            out = norm_forward(x, kind, eps, offset, weight, bias).float()
        err = (out - ref).abs().max().item()
        if err <= tol:
            return kind, offset, float(eps)
        errors.append(f"{kind}{'(1+w)' if offset else ''}: {err:.2g}")
    raise GenericLoadError(
        f"the final norm {path} ({type(norm).__name__}) is neither LayerNorm nor RMSNorm as reward-lens "
        f"computes them (max errors {', '.join(errors)}; tolerance {tol:.2g}); the reward cannot be "
        "decomposed exactly. Ask for a native weight map for this architecture"
    )


def norm_forward(x, kind, eps, offset, weight, bias, scale_hook=None, normalized_hook=None):
    xf = x.float()
    if kind == "LN":
        xf = xf - xf.mean(-1, keepdim=True)
    scale = (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if scale_hook is not None:
        scale = scale_hook(scale)
    normalized = xf / scale
    if weight is None and bias is None:
        normalized = normalized.to(x.dtype)
        return normalized_hook(normalized) if normalized_hook is not None else normalized
    if normalized_hook is not None:
        normalized = normalized_hook(normalized)
    out = normalized
    if weight is not None:
        out = out * (offset + weight.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class GenericFinalNorm(nn.Module):
    """The checkpoint's final norm recomputed with hooks: hook_scale [batch, pos, 1] (float32) and
    hook_normalized ((x - mean) / scale for LayerNorm, x / scale for RMSNorm, before any weight).

    Un-folded, it applies the transformers module's own weight and bias (read, not copied); folded
    (`w is None`), it returns the normalised residual and the weight lives in the reward head.
    """

    def __init__(self, kind: str, eps: float, offset: float, source: Optional[nn.Module]):
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.offset = offset
        self._source = (source,)  # a tuple, so the transformers module is not registered twice
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    @property
    def w(self) -> Optional[torch.Tensor]:
        src = self._source[0]
        return getattr(src, "weight", None) if src is not None else None

    @property
    def b(self) -> Optional[torch.Tensor]:
        src = self._source[0]
        return getattr(src, "bias", None) if src is not None else None

    @property
    def gain(self) -> Optional[torch.Tensor]:
        """(offset + w) when the checkpoint's weight is applied here; None when folded into the head."""
        w = self.w
        return None if w is None else self.offset + w

    @property
    def centers_direction(self) -> bool:
        """Whether a head direction read through this norm is centred: an unfolded LayerNorm (folded, the
        head already holds the centred direction)."""
        return self.kind == "LN" and not (self.w is None and self.b is None)

    def normalized(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """(x - mean) / scale for LayerNorm, x / scale for RMSNorm, in float32; hooks do not fire."""
        return norm_forward(x.float(), self.kind, self.eps, self.offset, None, None)

    def forward(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        return norm_forward(
            x, self.kind, self.eps, self.offset, self.w, self.b, self.hook_scale, self.hook_normalized
        )
