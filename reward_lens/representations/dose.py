"""Concept vectors as causes: the reward's dose-response to steering along a concept vector, and the
concept's effect on the reward (`reward_lens.representations.concepts` builds the vectors)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from reward_lens.core.readout import batches, readout_run, tokenize
from reward_lens.model.heads.base import read_objective
from reward_lens.model.hooks import act_name
from reward_lens.model.validation import check_model, checked_arguments
from reward_lens.plotting import figure_axes, finish
from reward_lens.representations.concepts import (
    ConceptVector,
    as_contrast,
    objective_directions,
    response_texts,
)


# ---------------------------------------------------------------------------------------------- causal
def _fit(alphas: torch.Tensor, y: torch.Tensor) -> Tuple[float, float, float]:
    """Least-squares y ≈ a + b·α: (slope b, intercept a, R²)."""
    a, y = alphas.double(), y.double()
    am, ym = a.mean(), y.mean()
    sxx = ((a - am) ** 2).sum()
    slope = ((a - am) * (y - ym)).sum() / sxx
    intercept = ym - slope * am
    ss_res = ((y - intercept - slope * a) ** 2).sum()
    ss_tot = ((y - ym) ** 2).sum()
    # R² needs a varying response and more points than the line's two parameters; otherwise it is undefined.
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 and a.unique().numel() > 2 else torch.tensor(float("nan"))
    return float(slope), float(intercept), float(r2)


@dataclass
class DoseResponse:
    """Rewards after adding α·scale·v̂ at `hook_name`, per item and α; fit on the mean over items.

    rewards: [n_rows, n_alpha], one row per evaluated response (for pairs: each pair's positive/chosen,
    then its negative/rejected), the model's output (reward, or ArmoRM's gated score / set objective);
    objectives: [n_rows, n_alpha, n_obj] for ArmoRM. slope is in reward per α (α in units of `scale`).
    """

    concept: str
    hook_name: str
    alphas: torch.Tensor
    scale: float
    positions: str
    rewards: torch.Tensor
    slope: float
    intercept: float
    r2: float
    item_slopes: torch.Tensor
    objective_names: Optional[List[str]] = None
    objectives: Optional[torch.Tensor] = None

    def objective_fits(self):
        """Per objective: slope, intercept, R² of the mean objective reward vs α (ArmoRM; else empty)."""
        import pandas as pd

        if self.objectives is None:
            return pd.DataFrame(columns=["objective", "slope", "intercept", "r2"])
        rows = []
        for j, name in enumerate(self.objective_names):
            s, i, r2 = _fit(self.alphas, self.objectives[:, :, j].mean(0))
            rows.append({"objective": name, "slope": s, "intercept": i, "r2": r2})
        return pd.DataFrame(rows)

    def to_frame(self):
        import pandas as pd

        n_items, n_alpha = self.rewards.shape
        frame = pd.DataFrame(
            {
                "item": torch.arange(n_items).repeat_interleave(n_alpha).numpy(),
                "alpha": self.alphas.repeat(n_items).numpy(),
                "reward": self.rewards.reshape(-1).numpy(),
            }
        )
        frame.insert(0, "concept", self.concept)
        frame.insert(1, "hook", self.hook_name)
        return frame

    def summary(self):
        """One row: the fit of the mean reward against α (slope, intercept, R²) and the spread of item
        slopes."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "concept": self.concept,
                    "hook": self.hook_name,
                    "n_items": self.rewards.shape[0],
                    "n_alphas": self.rewards.shape[1],
                    "scale": self.scale,
                    "slope": self.slope,
                    "intercept": self.intercept,
                    "r2": self.r2,
                    "item_slope_median": float(self.item_slopes.median()),
                    "frac_items_positive_slope": float((self.item_slopes > 0).float().mean()),
                }
            ]
        )

    def plot(self, ax=None):
        """Mean reward vs α with the 10–90% band over items and the linear fit."""
        created = ax is None
        fig, ax = figure_axes(ax, (5.5, 3.6))
        a = self.alphas.numpy()
        mean = self.rewards.mean(0).numpy()
        lo, hi = (
            torch.quantile(self.rewards, 0.1, dim=0).numpy(),
            torch.quantile(self.rewards, 0.9, dim=0).numpy(),
        )
        ax.fill_between(a, lo, hi, alpha=0.2, label="items 10–90%")
        ax.plot(a, mean, marker="o", label="mean reward")
        ax.plot(
            a,
            self.intercept + self.slope * a,
            ls="--",
            color="k",
            label=f"fit: slope {self.slope:.3g}, R² {self.r2:.3f}",
        )
        ax.set_xlabel(f"α  (added α·{self.scale:.3g}·v̂ at {self.hook_name})")
        ax.set_ylabel("reward")
        ax.set_title(f"dose-response: {self.concept}")
        ax.legend(fontsize=8)
        return finish(fig, created)


def _steered_rewards(
    model, tok, hook_name: str, shift: torch.Tensor, positions: str, n_alpha: int, track_objectives: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rewards [b, n_alpha] (and ArmoRM objectives [b, n_alpha, n_obj]) of one tokenized batch, each sequence
    repeated n_alpha times with `shift` [b·n_alpha, d] added at `hook_name` (every position or the
    readout)."""
    b = tok.input_ids.shape[0]
    ids = tok.input_ids.repeat_interleave(n_alpha, 0)
    mask = tok.attention_mask.repeat_interleave(n_alpha, 0)
    readout = tok.readout.repeat_interleave(n_alpha, 0)

    def add(resid: torch.Tensor, hook) -> torch.Tensor:
        if positions == "all":
            return resid + shift[:, None, :]
        resid = resid.clone()
        rows = torch.arange(resid.shape[0], device=resid.device)
        resid[rows, readout.to(resid.device)] += shift
        return resid

    grabbed = {}

    def grab(pooled: torch.Tensor, hook) -> None:
        grabbed["objectives"] = pooled.detach()

    hooks = [(hook_name, add)] + ([("reward_head.hook_pooled", grab)] if track_objectives else [])
    r = model.run_with_hooks(ids, mask, readout_positions=readout, fwd_hooks=hooks)
    if r.dim() != 1:
        raise ValueError(
            f"dose_response needs one reward per sequence; this model outputs {tuple(r.shape[1:])} per "
            "sequence"
        )
    objs = grabbed["objectives"].float().reshape(b, n_alpha, -1) if track_objectives else None
    return r.detach().float().reshape(b, n_alpha), objs


@checked_arguments(counts={"batch_size": 1})
@torch.no_grad()
def dose_response(
    model,
    concept: Union[ConceptVector, torch.Tensor],
    items: Any = None,
    *,
    layer: Optional[int] = None,
    alphas: Optional[Sequence[float]] = None,
    positions: str = "all",
    scale: Optional[float] = None,
    objective: Union[int, str, None] = None,
    batch_size: int = 8,
    progress: bool = False,
) -> DoseResponse:
    """Causal dose-response of the reward to a concept direction added at layer `layer`.

    items: held-out ContrastPairs / PreferencePairs (every response is evaluated) or (prompts, responses);
    default: the concept vector's held-out `test_items`. alphas default to 11 points in [−0.25, 0.25].
    positions: "all" adds the vector at every token (steering; for ArmoRM the gate's input moves too),
    "readout" only where the reward is read.
    scale (ρ) defaults to the median residual norm at the readout over the items at that layer.
    `objective` (ArmoRM) makes one objective the reward; otherwise ArmoRM's gated score is the reward and
    every objective's response is recorded too.
    """
    check_model(model, "dose_response")
    if positions not in ("all", "readout"):
        raise ValueError(f"positions must be 'all' or 'readout', got {positions!r}")
    if isinstance(concept, ConceptVector):
        idx = concept.index_of(layer)
        layer = concept.layers[idx]
        v_hat = concept.vector(layer)
        hook_name, name = concept.hook_name(layer), concept.name
        if items is None:
            items = concept.test_items
    else:
        if layer is None:
            raise ValueError(
                "with a raw direction, pass layer=<l> (the vector is added at blocks.l.hook_resid_post)"
            )
        if concept.shape != (model.cfg.d_model,):
            raise ValueError(
                f"the direction must have shape [d_model={model.cfg.d_model}], got {tuple(concept.shape)}"
            )
        v_hat = concept.float() / concept.float().norm()
        hook_name, name = act_name("resid_post", layer), "direction"
    if items is None or (not isinstance(items, tuple) and len(items) == 0):
        raise ValueError("no held-out items to evaluate the dose-response on; pass items=")
    prompts, responses = response_texts(items)
    alphas_t = (
        torch.linspace(-0.25, 0.25, 11) if alphas is None else torch.tensor(list(alphas), dtype=torch.float32)
    )
    if alphas_t.numel() < 2 or alphas_t.unique().numel() < 2:
        raise ValueError("alphas needs at least two distinct values")
    with read_objective(model, objective):
        if scale is None:
            clean = readout_run(model, prompts, responses, [hook_name], batch_size=batch_size)
            scale = float(clean.acts[hook_name].float().norm(dim=-1).median())
        finite_v = bool(torch.isfinite(v_hat).all()) and bool(v_hat.any())
        if not (math.isfinite(scale) and scale != 0) or not finite_v:
            raise ValueError(
                f"scale={scale} and a direction of norm {float(v_hat.norm()):.3g} add no finite "
                "intervention; give a non-zero, finite scale and direction"
            )
        n_alpha = alphas_t.numel()
        v = v_hat.to(device=model.cfg.device, dtype=model.cfg.dtype)
        track_objectives = (
            bool(model.reward_head.n_objectives) and "reward_head.hook_pooled" in model.hook_dict
        )
        out_rewards, out_objs = [], []
        for sl in batches(len(prompts), max(1, batch_size), "dose-response" if progress else False):
            tok = tokenize(model, prompts[sl], responses[sl])
            shift = (alphas_t.repeat(tok.input_ids.shape[0]).to(v.device, v.dtype) * scale)[:, None] * v
            r, objs = _steered_rewards(model, tok, hook_name, shift, positions, n_alpha, track_objectives)
            out_rewards.append(r)
            if track_objectives:
                out_objs.append(objs)
    rewards = torch.cat(out_rewards)
    slope, intercept, r2 = _fit(alphas_t, rewards.mean(0))
    item_slopes = torch.tensor([_fit(alphas_t, row)[0] for row in rewards])
    objs = objective_directions(model)
    return DoseResponse(
        concept=name,
        hook_name=hook_name,
        alphas=alphas_t,
        scale=float(scale),
        positions=positions,
        rewards=rewards,
        slope=slope,
        intercept=intercept,
        r2=r2,
        item_slopes=item_slopes,
        objective_names=objs[0] if (objs is not None and out_objs) else None,
        objectives=torch.cat(out_objs) if out_objs else None,
    )


@checked_arguments(counts={"batch_size": 1})
@torch.no_grad()
def concept_effect(
    model, items: Any, *, batch_size: int = 8, objective: Union[int, str, None] = None
) -> torch.Tensor:
    """Per contrast pair: reward(positive) − reward(negative) (the concept's behavioural effect), [n]."""
    _, items = as_contrast(items)
    prompts = [it.prompt for it in items]
    with read_objective(model, objective):
        pos = readout_run(model, prompts, [it.positive for it in items], batch_size=batch_size).rewards
        neg = readout_run(model, prompts, [it.negative for it in items], batch_size=batch_size).rewards
    return (pos - neg).float()
