"""Concept erasure fitted on a policy's own completions, folded into the reward model.

LEACE (Belrose et al. 2023, "LEACE: Perfect linear concept erasure in closed form"): for activations x with
covariance Σ_xx and cross-covariance Σ_xz with a concept z, the affine map

    r(x) = x − W⁺ P W (x − μ),   W = Σ_xx^{-1/2},  P = the orthogonal projection onto colspace(W Σ_xz)

makes Cov(r(x), z) = 0, so no linear read-out of r(x) correlates with z, and it moves x the least doing so
(in the Σ_xx metric). Fitted on *group-centred* data (each prompt group's mean subtracted from x and z),
it removes what GRPO climbs: the within-group covariance of the reward with z.

Two placements:
* `erase_at_head`: one eraser on the head's input (the final norm's output at the readout). The reward is
  linear in it, r = d · n + b, so the eraser folds exactly into the head: d' = (I − A)ᵀ d,
  b' = b + d · A μ with A = W⁺ P W. The edited model is an ordinary checkpoint; nothing downstream can
  recompute z, because nothing is downstream.
* `scrub_layers` (concept scrubbing): an eraser on every block's output (`resid_post`, every position),
  each fitted on the residuals of the model with the earlier erasers in place, as permanent hooks.

Both are exact on their fitting data (tested: Cov = 0 to fp32 rounding, and the folded head equals the
eraser applied to the head input); `concept-erasure`'s `LeaceFitter` gives the same map (a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from reward_lens.model.hooks import act_name
from reward_lens.representations.editing import copy_model


@dataclass
class Eraser:
    """x ↦ x − (x − mean) Aᵀ: the LEACE map with A = W⁺ P W [d, d] and the fitting data's mean [d]."""

    A: torch.Tensor
    mean: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        A, mu = self.A.to(x.device, torch.float32), self.mean.to(x.device, torch.float32)
        return (x.float() - (x.float() - mu) @ A.T).to(x.dtype)


def _centre(t: torch.Tensor, groups: Optional[np.ndarray]) -> torch.Tensor:
    if groups is None:
        return t - t.mean(0)
    out = t.clone()
    g = torch.as_tensor(np.asarray(groups))
    for value in torch.unique(g):
        m = g == value
        out[m] = t[m] - t[m].mean(0)
    return out


def fit_leace(
    x: torch.Tensor, z: torch.Tensor, groups: Optional[Sequence[int]] = None, tol: float = 1e-6
) -> Eraser:
    """The LEACE eraser of concept `z` ([n] or [n, k]) from `x` [n, d], in float64. `groups`: one id per
    row; covariances are then taken within groups (each group's mean removed), the erasure's mean is still
    the overall one. Eigenvalues of Σ_xx below `tol` × the largest are treated as zero (pseudo-inverse)."""
    x = torch.as_tensor(x).double()
    z = torch.as_tensor(z).double().reshape(len(x), -1)
    if len(x) < 2:
        raise ValueError("LEACE needs at least 2 rows of activations")
    g = None if groups is None else np.asarray(groups)
    xc, zc = _centre(x, g), _centre(z, g)
    n = len(x)
    sxx = xc.T @ xc / n
    sxz = xc.T @ zc / n
    lam, V = torch.linalg.eigh(sxx)
    keep = lam > tol * lam.max().clamp(min=1e-300)
    inv_sqrt = torch.zeros_like(lam)
    sqrt = torch.zeros_like(lam)
    inv_sqrt[keep] = lam[keep].rsqrt()
    sqrt[keep] = lam[keep].sqrt()
    W = V @ torch.diag(inv_sqrt) @ V.T
    W_pinv = V @ torch.diag(sqrt) @ V.T
    u = W @ sxz
    U, s, _ = torch.linalg.svd(u, full_matrices=False)
    Q = U[:, s > 1e-12 * s.max().clamp(min=1e-300)] if s.numel() else U[:, :0]
    A = W_pinv @ (Q @ Q.T) @ W
    return Eraser(A.float(), x.mean(0).float())


def _require_scalar_head(model) -> None:
    head = model.reward_head
    if head.is_gated or head.nonlinear_readout or model.cfg.n_outputs != 1 or not hasattr(head, "W_R"):
        raise ValueError(
            "folding an eraser into the head supports the scalar linear head (head_type 'scalar'); this "
            f"model has {model.cfg.head_type!r}: use scrub_layers instead"
        )


def head_inputs(
    model, prompts: Sequence[Any], responses: Sequence[Any], batch_size: int = 32
) -> torch.Tensor:
    """The normalised final residual at each readout, n = resid_final / scale [n, d_model] (float32): what
    the head reads, before the final norm's gain (r = (gain ⊙ W_R) · n + b)."""
    from reward_lens.core.readout import readout_run

    name = act_name("final_normalized")
    run = readout_run(model, list(prompts), list(responses), names_filter=[name], batch_size=batch_size)
    return run.acts[name].float()


@torch.no_grad()
def erase_at_head(model, eraser: Eraser):
    """A copy of the model whose scalar head reads eraser(n) instead of n, folded into W_R and b_R (exact;
    see the module docstring)."""
    _require_scalar_head(model)
    edited = copy_model(model)
    head = edited.reward_head
    gain = edited.ln_final.gain
    g = torch.ones(edited.cfg.d_model) if gain is None else gain.detach().float().cpu()
    if bool((g.abs() < 1e-12).any()):
        raise ValueError(
            "the final norm has zero weights, so the head cannot absorb the eraser; load with fold_ln=True"
        )
    d = g * head.W_R[:, 0].detach().float().cpu()
    A, mu = eraser.A.float().cpu(), eraser.mean.float().cpu()
    d_new = d - A.T @ d
    head.W_R[:, 0] = (d_new / g).to(head.W_R.dtype).to(head.W_R.device)
    head.b_R[0] += (d @ (A @ mu)).to(head.b_R.dtype).to(head.b_R.device)
    return edited


def residuals_all_positions(model, prompts, responses, layer: int, batch_size: int = 32) -> tuple:
    """resid_post of `layer` at every non-pad position [tokens, d_model] and the row each token came from."""
    from reward_lens.core.batching import tokenize

    name = act_name("resid_post", layer)
    xs, rows = [], []
    for start in range(0, len(prompts), batch_size):
        tok = tokenize(
            model, list(prompts[start : start + batch_size]), list(responses[start : start + batch_size])
        )
        _, cache = model.run_with_cache(tok.input_ids, attention_mask=tok.attention_mask, names_filter=[name])
        mask = tok.attention_mask.bool()
        xs.append(cache[name][mask].float().cpu())
        rows.append((torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask.cpu()] + start))
    return torch.cat(xs), torch.cat(rows)


@torch.no_grad()
def scrub_layers(model, prompts, responses, z, groups=None, batch_size: int = 32):
    """A copy of the model with a LEACE eraser of `z` (one value per text) on every block's resid_post at
    every position, fitted layer by layer on the texts with the earlier erasers in place (concept
    scrubbing); the erasers are permanent hooks. Returns (model, erasers)."""
    edited = copy_model(model)
    z = torch.as_tensor(np.asarray(z, np.float64))
    erasers: List[Eraser] = []
    for layer in range(edited.cfg.n_layers):
        x, rows = residuals_all_positions(edited, prompts, responses, layer, batch_size)
        g = None if groups is None else np.asarray(groups)[rows.numpy()]
        eraser = fit_leace(x, z[rows], g)
        erasers.append(eraser)
        edited.add_hook(act_name("resid_post", layer), lambda t, hook, e=eraser: e(t), is_permanent=True)
    return edited, erasers
