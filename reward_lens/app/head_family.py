"""The audit's head-family view: which head family the model reads its reward through, and, for heads with
a per-sequence direction (ArmoRM's gate, an MLP head's frozen ReLU masks), how much that direction moves
across the audited sequences (the cosine spread a user asks for first: near 1 everywhere means the head
is close to one linear direction; low values mean each sequence is read along its own direction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import pandas as pd
import torch

from reward_lens.core.pipeline import Shared, Spec, run_spec


def _stats(x: torch.Tensor) -> Dict[str, float]:
    x = x.double()
    return {
        "mean": float(x.mean()),
        "min": float(x.min()),
        "p05": float(torch.quantile(x, 0.05)),
        "max": float(x.max()),
    }


@dataclass
class ReadoutDirections:
    """Each pair's per-sequence reward directions [n_pairs, d_model], chosen and rejected."""

    pair_ids: List[str]
    chosen: torch.Tensor
    rejected: torch.Tensor


class DirectionsSpec(Spec):
    """The per-sequence reward directions as a pipeline instrument: the directions the other instruments'
    steps compute anyway (memoised per batch and side), so they cost no forward of their own."""

    name = "directions"

    def step(self, model, shared: Shared) -> ReadoutDirections:
        c, r = (shared.direction(model, side)[0].float() for side in ("chosen", "rejected"))
        return ReadoutDirections(shared.pair_ids, c, r)


def direction_spread(directions: ReadoutDirections) -> Dict[str, Dict[str, float]]:
    """Cosines of the per-sequence reward directions (chosen and rejected of every pair): to their mean
    direction, between all pairs of sequences, and between each pair's chosen and rejected."""
    c = torch.nn.functional.normalize(directions.chosen.double(), dim=-1)
    r = torch.nn.functional.normalize(directions.rejected.double(), dim=-1)
    every = torch.cat([c, r])
    mean = torch.nn.functional.normalize(every.mean(0), dim=0)
    gram = every @ every.T
    off = gram[~torch.eye(len(every), dtype=torch.bool)]
    return {
        "to_mean_direction": _stats(every @ mean),
        "between_sequences": _stats(off),
        "chosen_vs_rejected": _stats((c * r).sum(-1)),
    }


def head_family_view(
    model, pairs: Sequence, batch_size: int, directions: Optional[ReadoutDirections] = None
) -> Dict[str, Any]:
    """{"summary": what results.json records, "frame": the cosine-spread table (None for one direction)}.
    `directions`: the pairs' `ReadoutDirections` when already computed (the audit's shared passes)."""
    head = model.reward_head
    summary: Dict[str, Any] = {
        "family": head.family,
        "head_class": type(head).__name__,
        "per_sequence_direction": bool(head.is_gated),
        "per_step": bool(head.per_step),
    }
    if head.per_step:
        summary["step_read"] = head.step
    frame = None
    if head.is_gated:
        if directions is None:
            directions = run_spec(model, pairs, DirectionsSpec(), batch_size=batch_size)
        spread = direction_spread(directions)
        summary["direction_cosine"] = spread
        frame = pd.DataFrame([{"cosine": k, **v} for k, v in spread.items()])
    return {"summary": summary, "frame": frame}


def head_family_text(summary: Dict[str, Any]) -> str:
    """The report's sentence on the head family."""
    text = f"The reward is read through a {summary['family']} head ({summary['head_class']})."
    if summary.get("per_step"):
        text += (
            f" A process reward model: every instrument read step {summary['step_read']} "
            "(reward_lens.read_step)."
        )
    if summary["per_sequence_direction"]:
        spread = summary["direction_cosine"]["to_mean_direction"]
        text += (
            " Its reward is linear in the final residual along a per-sequence direction (a gate or ReLU "
            "mask frozen at the sequence's value, exactly); the directions' cosine to their mean is "
            f"{spread['mean']:.3f} on average (min {spread['min']:.3f})."
        )
    return text
