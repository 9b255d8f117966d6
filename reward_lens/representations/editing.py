"""Reward editing: remove a concept direction from what the reward reads, verify, export.

Two weight edits (both exact, so the edited model exports as an ordinary checkpoint):

* `where="head"`: every weight that reads the final-norm output (the score head; for ArmoRM the
  regression layer and the gate's first layer) is made blind to v̂: with g the final norm's weight (1 when
  folded) and W a reader, diag(g)·W ← (I − v̂v̂ᵀ)·diag(g)·W. Then w·v̂ = 0: moving the final residual
  along v̂ no longer moves the reward (except through the final norm's scale).
* `where=<layer l>`: v̂ is projected out of everything written into the residual stream up to and
  including block l (embedding, attention and MLP output maps and biases), so the residual
  `blocks.l.hook_resid_post` has no component along v̂ at any position (later blocks may write it again).

`edit_reward` then measures, on held-out probes (contrast pairs), the concept's effect
mean(reward(positive) − reward(negative)) before and after, and the accuracy on preference pairs before
and after, and returns a `RewardEdit` whose `export(path)` writes a transformers checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from reward_lens.core.readout import readout_run
from reward_lens.data.pairs import PreferencePair, as_pairs
from reward_lens.loading.export import export_hf
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import finish, panels
from reward_lens.representations.concepts import ConceptVector
from reward_lens.representations.dose import concept_effect


def copy_model(model):
    """A deep copy of the model that shares its tokenizer (tokenizers need not be copied)."""
    tokenizer = model.tokenizer
    model.tokenizer = None  # tokenizers need not be deep-copied; the edit shares the original's
    try:
        edited = copy.deepcopy(model)
    finally:
        model.tokenizer = tokenizer
    edited.tokenizer = tokenizer
    return edited


def _project_along(W: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """W with its axis `dim` (of length d_model) projected orthogonally to unit v."""
    Wm = W.movedim(dim, -1)
    Wm = Wm - (Wm @ v)[..., None] * v
    return Wm.movedim(-1, dim)


@torch.no_grad()
def project_out_of_head(model, v: torch.Tensor) -> None:
    """In place: every reader of the final-norm output becomes blind to residual direction v (unit)."""
    head = model.reward_head
    readers = head.final_norm_readers
    gain = None if model.ln_final.gain is None else model.ln_final.gain.float()
    if gain is not None and bool((gain.abs() < 1e-12).any()):
        raise ValueError(
            "the final norm has zero weights, so the head cannot be re-expressed; load with fold_ln=True"
        )
    for name, dim in readers:
        param = head.get_parameter(name)
        W = param.float()
        shape = [1] * W.dim()
        shape[dim] = -1
        if gain is not None:
            W = W * gain.view(shape)
        W = _project_along(W, v.float().to(W.device), dim)
        if gain is not None:
            W = W / gain.view(shape)
        param.copy_(W.to(param.dtype))


@torch.no_grad()
def project_out_of_residual(model, v: torch.Tensor, layer: int) -> None:
    """In place: v (unit) is projected out of the embedding and of every attention/MLP output map and bias
    of blocks 0..layer, so blocks.{layer}.hook_resid_post has no component along v."""
    cfg = model.cfg
    writers = [param for block in model.blocks[: layer + 1] for _, param in block.residual_writers()]
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} out of range: the model has {cfg.n_layers} layers")
    v = v.to(device=model.W_E.device, dtype=torch.float32)

    def proj(param: torch.nn.Parameter, dim: int = -1) -> None:
        param.copy_(
            _project_along(param.float(), v.to(param.device), dim if dim >= 0 else param.dim() + dim).to(
                param.dtype
            )
        )

    proj(model.embed.W_E)
    for param in writers:  # every map and bias whose output the blocks add to the residual
        proj(param)


@dataclass
class RewardEdit:
    """An edited copy of the model and the verification numbers.

    effect_*: mean over held-out probes of reward(positive) − reward(negative); accuracy_*: fraction of
    preference pairs with reward(chosen) > reward(rejected) (None without pairs). `verified` holds when the
    effect's magnitude fell to at most `max_effect_ratio` of before and accuracy fell by at most
    `max_accuracy_drop`.
    """

    model: Any
    direction: torch.Tensor
    where: str
    layer: Optional[int]
    effect_before: float
    effect_after: float
    accuracy_before: Optional[float]
    accuracy_after: Optional[float]
    n_probes: int
    n_pairs: int
    max_effect_ratio: float = 0.5
    max_accuracy_drop: float = 0.02

    @property
    def effect_reduction(self) -> float:
        """1 − |effect after| / |effect before| (1: the concept no longer moves the reward)."""
        if self.effect_before == 0:
            return float("nan")
        return 1.0 - abs(self.effect_after) / abs(self.effect_before)

    @property
    def accuracy_change(self) -> Optional[float]:
        if self.accuracy_before is None:
            return None
        return self.accuracy_after - self.accuracy_before

    @property
    def verified(self) -> bool:
        effect_ok = abs(self.effect_after) <= self.max_effect_ratio * abs(self.effect_before)
        acc_ok = (
            self.accuracy_before is None
            or self.accuracy_after >= self.accuracy_before - self.max_accuracy_drop
        )
        return bool(effect_ok and acc_ok)

    def export(self, path: Union[str, Path], *, hf_config: Any = None, dtype=None) -> Path:
        """Write the edited model as a transformers LlamaForSequenceClassification checkpoint."""
        return export_hf(self.model, path, hf_config=hf_config, dtype=dtype)

    def to_frame(self):
        import pandas as pd

        rows = [{"metric": "concept_effect", "before": self.effect_before, "after": self.effect_after}]
        if self.accuracy_before is not None:
            rows.append(
                {"metric": "pair_accuracy", "before": self.accuracy_before, "after": self.accuracy_after}
            )
        frame = pd.DataFrame(rows)
        frame.insert(0, "edit", self.where)
        return frame

    def summary(self):
        """One row: where, the concept effect before and after, its reduction, accuracies, verified."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "edit": self.where,
                    "layer": self.layer,
                    "effect_before": self.effect_before,
                    "effect_after": self.effect_after,
                    "effect_reduction": self.effect_reduction,
                    "accuracy_before": self.accuracy_before,
                    "accuracy_after": self.accuracy_after,
                    "n_probes": self.n_probes,
                    "n_pairs": self.n_pairs,
                    "verified": self.verified,
                }
            ]
        )

    def plot(self, ax=None):
        """Before/after bars for the concept effect and the pair accuracy (one panel each)."""
        frame = self.to_frame()
        created = ax is None
        fig, axes = panels(ax, len(frame), (3.2 * len(frame), 3.2))
        for ax, (_, row) in zip(axes, frame.iterrows()):
            ax.bar(["before", "after"], [row["before"], row["after"]], color=["C0", "C1"])
            ax.set_title(row["metric"])
            ax.axhline(0, color="grey", lw=0.5)
        if created:
            fig.suptitle(f"edit: {self.where} ({'verified' if self.verified else 'NOT verified'})")
        return finish(fig, created)


def _accuracy(model, pairs, batch_size: int) -> float:
    prompts = [p.prompt for p in pairs]
    chosen = readout_run(model, prompts, [p.chosen for p in pairs], batch_size=batch_size).rewards
    rejected = readout_run(model, prompts, [p.rejected for p in pairs], batch_size=batch_size).rewards
    return float((chosen > rejected).float().mean())


@checked_arguments(counts={"batch_size": 1})
@torch.no_grad()
def edit_reward(
    model,
    concept: Union[ConceptVector, torch.Tensor],
    *,
    where: Union[str, int] = "head",
    layer: Optional[int] = None,
    probes: Any = None,
    pairs: Union[Sequence[PreferencePair], str, None] = None,
    batch_size: int = 8,
    max_effect_ratio: float = 0.5,
    max_accuracy_drop: float = 0.02,
) -> RewardEdit:
    """Remove `concept` from the reward, by projecting it out of the head (`where="head"`) or out of the
    residual at layer `where` (an int); the original model is left untouched.

    concept: a ConceptVector (its vector at `layer`; default: its last layer for a head edit, layer `where`
    for a residual edit) or a raw direction [d_model]. probes: held-out ContrastPairs (default: the concept
    vector's `test_items`); pairs: preference pairs whose accuracy must be kept (optional).
    """
    if isinstance(concept, ConceptVector):
        if layer is None:
            layer = where if isinstance(where, int) and where in concept.layers else concept.layers[-1]
        v = concept.vector(layer)
        if probes is None:
            probes = concept.test_items
    else:
        if concept.shape != (model.cfg.d_model,):
            raise ValueError(
                f"the direction must have shape [d_model={model.cfg.d_model}], got {tuple(concept.shape)}"
            )
        v = concept.float()
    norm = float(v.detach().float().norm())
    if not norm > 0 or not torch.isfinite(v).all():  # 0/0 would give a NaN direction, then NaN rewards
        raise ValueError(
            f"the concept direction is {'zero' if norm == 0 else 'not finite'} (norm {norm}), so there is "
            "nothing to project out; build the concept from contrast pairs that differ (concept_vector) or "
            "pass a non-zero direction"
        )
    if probes is None or len(probes) == 0:
        raise ValueError(
            "edit_reward verifies on held-out probes: pass probes=<ContrastPairs> (not used to build the "
            "concept)"
        )
    v = v.detach().float()
    if not isinstance(concept, ConceptVector):
        v = v / v.norm()
    edited = copy_model(model)
    if where == "head":
        project_out_of_head(edited, v)
        label, edit_layer = "head", None
    elif isinstance(where, int) and not isinstance(where, bool):
        project_out_of_residual(edited, v, where)
        label, edit_layer = f"resid L{where}", where
    else:
        raise ValueError(f"where must be 'head' or a layer index, got {where!r}")
    before = float(concept_effect(model, probes, batch_size=batch_size).mean())
    after = float(concept_effect(edited, probes, batch_size=batch_size).mean())
    acc_before = acc_after = None
    n_pairs = 0
    if pairs is not None:
        pairs = as_pairs(pairs)
        n_pairs = len(pairs)
        acc_before, acc_after = _accuracy(model, pairs, batch_size), _accuracy(edited, pairs, batch_size)
    return RewardEdit(
        model=edited,
        direction=v,
        where=label,
        layer=edit_layer,
        effect_before=before,
        effect_after=after,
        accuracy_before=acc_before,
        accuracy_after=acc_after,
        n_probes=len(probes),
        n_pairs=n_pairs,
        max_effect_ratio=max_effect_ratio,
        max_accuracy_drop=max_accuracy_drop,
    )
