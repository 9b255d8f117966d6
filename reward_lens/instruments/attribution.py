"""Exact direct attribution of the reward (and of the reward gap) to every component, head and neuron.

The reward is linear in the final residual at the readout once the final norm's scale is fixed:

    reward = w . resid_final / s + b,   resid_final = embed + sum_l (attn_out_l + mlp_out_l)

with w the reward direction (`model.reward_direction`, or ArmoRM's per-sequence
`model.reward_direction_for`), s the real `ln_final.hook_scale` at the readout and b the head's bias. So
each component's term is w . component / s and the terms sum to reward - b exactly (up to fp32
rounding). A head's term is w . (z_h W_O[h]) / s; the heads of a layer plus its b_O term sum to the
layer's attention term. A neuron's term is post_i * (W_out[i] . w) / s; with b_out they sum to the MLP
term. On Gemma-2 the post-norms' real scales are frozen the same way, so the identities still hold.
Ignoring s (as some tools do) misses the reward by the factor s, often 10-100x.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.instruments.sites import component_sites
from reward_lens.model.hooks import act_name
from reward_lens.model.validation import check_model, checked_arguments
from reward_lens.plotting import figure_axes, finish
from reward_lens.results import PairRewards, to_numpy

# Relative error above which the decomposition is reported as not reproducing the model's reward: the
# terms are exact up to rounding, which in bf16/fp16 (8/11-bit mantissas) is far above fp32's.
CHECK_RTOL = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


@dataclass
class AttributionResult(PairRewards):
    """Per-pair direct attribution. `chosen`/`rejected` [n_pairs, n_components] in `components` order
    (embed, attn_L0, mlp_L0, ...); `gap` = chosen - rejected. `bias_*` [n_pairs] is the head's bias,
    `reward_*` [n_pairs] the model's own rewards (so `chosen.sum(-1) + bias_chosen == reward_chosen`).
    Heads: `heads_*` [n_pairs, n_layers, n_heads] and `head_bias_*` [n_pairs, n_layers] (the b_O term).
    Neurons (when requested): `neurons_*` [n_pairs, n_layers, d_mlp], `neuron_bias_*` [n_pairs, n_layers].
    """

    pair_ids: List[str]
    components: List[str]
    layers: List[int]
    chosen: Float[torch.Tensor, "pair component"]
    rejected: Float[torch.Tensor, "pair component"]
    bias_chosen: Float[torch.Tensor, " pair"]
    bias_rejected: Float[torch.Tensor, " pair"]
    reward_chosen: Float[torch.Tensor, " pair"]
    reward_rejected: Float[torch.Tensor, " pair"]
    heads_chosen: Optional[torch.Tensor] = None
    heads_rejected: Optional[torch.Tensor] = None
    head_bias_chosen: Optional[torch.Tensor] = None
    head_bias_rejected: Optional[torch.Tensor] = None
    neurons_chosen: Optional[torch.Tensor] = None
    neurons_rejected: Optional[torch.Tensor] = None
    neuron_bias_chosen: Optional[torch.Tensor] = None
    neuron_bias_rejected: Optional[torch.Tensor] = None

    @property
    def gap(self) -> torch.Tensor:
        return self.chosen - self.rejected

    def get(self, quantity: str = "gap") -> torch.Tensor:
        """[n_pairs, n_components] of "chosen", "rejected" or "gap"."""
        if quantity not in ("chosen", "rejected", "gap"):
            raise ValueError(f"quantity must be 'chosen', 'rejected' or 'gap', got {quantity!r}")
        return getattr(self, quantity)

    def max_relative_error(self) -> float:
        """max over pairs and both responses of |sum(terms) + bias - reward| / max(|reward|, 1e-6)."""
        errs = []
        for terms, bias, reward in (
            (self.chosen, self.bias_chosen, self.reward_chosen),
            (self.rejected, self.bias_rejected, self.reward_rejected),
        ):
            errs.append(
                (
                    (terms.double().sum(-1) + bias.double() - reward.double()).abs()
                    / reward.double().abs().clamp(min=1e-6)
                ).max()
            )
        return float(max(errs))

    def to_frame(self, level: str = "component") -> pd.DataFrame:
        """Tidy frame, one row per (pair, term): columns pair, component, layer, level, head, chosen,
        rejected, gap. level: "component", "head", "neuron" or "all"."""
        if level not in ("component", "head", "neuron", "all"):
            raise ValueError(f"level must be 'component', 'head', 'neuron' or 'all', got {level!r}")
        frames = []
        if level in ("component", "all"):
            frames.append(
                self._frame(
                    self.components,
                    self.layers,
                    [None] * len(self.components),
                    self.chosen,
                    self.rejected,
                    "component",
                )
            )
        if level in ("head", "all"):
            if self.heads_chosen is None:
                raise ValueError("this attribution has no head terms; run attribute(..., heads=True)")
            L, H = self.heads_chosen.shape[1:]
            names, layers, heads = [], [], []
            for l in range(L):
                names += [f"L{l}H{h}" for h in range(H)] + [f"L{l}_b_O"]
                layers += [l] * (H + 1)
                heads += list(range(H)) + [None]
            c = torch.cat([self.heads_chosen, self.head_bias_chosen[..., None]], -1).flatten(1)
            r = torch.cat([self.heads_rejected, self.head_bias_rejected[..., None]], -1).flatten(1)
            frames.append(self._frame(names, layers, heads, c, r, "head"))
        if level in ("neuron", "all"):
            if self.neurons_chosen is None:
                raise ValueError("this attribution has no neuron terms; run attribute(..., neurons=True)")
            L, N = self.neurons_chosen.shape[1:]
            names = [f"L{l}N{i}" for l in range(L) for i in range(N)]
            layers = [l for l in range(L) for _ in range(N)]
            frames.append(
                self._frame(
                    names,
                    layers,
                    [None] * len(names),
                    self.neurons_chosen.flatten(1),
                    self.neurons_rejected.flatten(1),
                    "neuron",
                )
            )
        return pd.concat(frames, ignore_index=True)

    def _frame(self, names, layers, heads, chosen, rejected, level) -> pd.DataFrame:
        n, C = chosen.shape
        c, r = to_numpy(chosen).ravel(), to_numpy(rejected).ravel()
        return pd.DataFrame(
            {
                "pair": [pid for pid in self.pair_ids for _ in range(C)],
                "component": names * n,
                "layer": layers * n,
                "level": level,
                "head": pd.array(heads * n, dtype="Int64"),
                "chosen": c,
                "rejected": r,
                "gap": c - r,
            }
        )

    def summary(self) -> pd.DataFrame:
        """One row per component: mean chosen, rejected and gap terms over pairs, mean |gap term|, and its
        share of the mean reward gap (the shares plus the bias's sum to 1)."""
        c, r = to_numpy(self.chosen), to_numpy(self.rejected)
        mean_gap = float(to_numpy(self.reward_gap).mean())
        return pd.DataFrame(
            {
                "component": self.components,
                "layer": self.layers,
                "mean_chosen": c.mean(0),
                "mean_rejected": r.mean(0),
                "mean_gap": (c - r).mean(0),
                "mean_abs_gap": np.abs(c - r).mean(0),
                "share_of_reward_gap": (c - r).mean(0) / mean_gap if mean_gap != 0 else np.nan,
            }
        )

    def plot(self, quantity: str = "gap", ax=None):
        """Mean term per component (bars) with the spread over pairs (std error bars)."""
        values = to_numpy(self.get(quantity))
        created = ax is None
        fig, ax = figure_axes(ax, (max(6, 0.25 * len(self.components)), 3.5))
        x = range(len(self.components))
        colors = [
            "tab:gray"
            if c in ("embed", "pos_embed")
            else "tab:blue"
            if c.startswith("attn")
            else "tab:orange"
            for c in self.components
        ]
        ax.bar(x, values.mean(0), yerr=values.std(0) if len(values) > 1 else None, color=colors)
        ax.set_xticks(list(x))
        ax.set_xticklabels(self.components, rotation=90, fontsize=7)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_ylabel(f"direct attribution ({quantity})")
        ax.set_title(f"Direct attribution of the reward {quantity} over {len(values)} pair(s)")
        return finish(fig, created)


def attribution_names(model, heads: bool, neurons: bool) -> List[str]:
    """The hooks the attribution reads at the readout."""
    cfg = model.cfg
    L = cfg.n_layers
    names = embed_names(model) + [act_name("final_scale")]
    names += [act_name(k, l) for l in range(L) for k in ("attn_out", "mlp_out")]
    if heads:
        names += [act_name("z", l) for l in range(L)]
    if neurons:
        names += [act_name("post", l) for l in range(L)]
    if (heads or neurons) and model.has_head_hooks:  # what the blocks' output steps need to be linear
        # (Gemma-2's post-norm scales); without head hooks the capture refuses hook_z / hook_post
        names += [h for block in model.blocks for h in block.output_gain_hooks()]
    return names


def embed_names(model) -> List[str]:
    standard = model.cfg.positional_embedding_type == "standard"
    return [act_name("embed")] + ([act_name("pos_embed")] if standard else [])


@torch.no_grad()
def attribution_terms(model, acts, rewards, direction, bias, heads: bool, neurons: bool):
    """The terms of one side of a batch from its readout activations (`attribution_names`)."""
    L = model.cfg.n_layers
    scale = acts[act_name("final_scale")].float()  # [B, 1]
    w = direction / scale  # the linear map each residual term goes through

    def term(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * w).sum(-1)

    comps = [term(acts[name]) for name in embed_names(model)]  # the order of component_sites
    for l in range(L):
        comps += [term(acts[act_name("attn_out", l)]), term(acts[act_name("mlp_out", l)])]
    out = {"terms": torch.stack(comps, -1), "bias": bias, "reward": rewards.float()}

    def output_read(l: int, which: str) -> torch.Tensor:
        # The direction a block's raw output is read along: the block's output step (e.g. Gemma-2's
        # post-norm, linear once its scale is frozen) folded into w.
        return w * model.blocks[l].output_gain(which, acts)

    if heads:
        per_head, head_bias = [], []
        for l in range(L):
            attn = model.blocks[l].attn
            wl = output_read(l, "attn")  # [B, d]
            read = torch.einsum("nhd,bd->bnh", attn.W_O.float().to(wl.device), wl)  # W_O[h] . w per head
            per_head.append((acts[act_name("z", l)].float() * read).sum(-1))
            head_bias.append((attn.b_O.float().to(wl.device) * wl).sum(-1))
        out["heads"], out["head_bias"] = torch.stack(per_head, 1), torch.stack(head_bias, 1)
    if neurons:
        per_neuron, neuron_bias = [], []
        for l in range(L):
            mlp = model.blocks[l].mlp
            wl = output_read(l, "mlp")
            read = wl @ mlp.W_out.float().to(wl.device).T  # [B, d_mlp]
            per_neuron.append(acts[act_name("post", l)].float() * read)
            neuron_bias.append((mlp.b_out.float().to(wl.device) * wl).sum(-1))
        out["neurons"], out["neuron_bias"] = torch.stack(per_neuron, 1), torch.stack(neuron_bias, 1)
    return out


class AttributionSpec(Spec):
    """Exact direct attribution as a pipeline instrument: reads the components' outputs (and heads' z,
    neurons' post) at the readout; checks the identity over all pairs when finished."""

    name = "attribution"

    def __init__(self, heads: Optional[bool] = None, neurons: bool = False):
        self.heads, self.neurons = heads, neurons

    def setup(self, model, pairs) -> None:
        if self.heads is None:
            self.heads = model.has_head_hooks
        self.names = attribution_names(model, self.heads, self.neurons)
        self.sites = component_sites(model.cfg)

    def reads(self, model, batch) -> Reads:
        return Reads.both(readout=self.names)

    def step(self, model, shared: Shared) -> AttributionResult:
        parts = {}
        for side in ("chosen", "rejected"):
            cap = shared.caps[side]
            direction, bias = shared.direction(model, side)
            parts[side] = attribution_terms(
                model, cap.at_readout, cap.rewards, direction, bias, self.heads, self.neurons
            )
        c, r = parts["chosen"], parts["rejected"]
        return AttributionResult(
            pair_ids=shared.pair_ids,
            components=[s.name for s in self.sites],
            layers=[s.layer for s in self.sites],
            chosen=c["terms"],
            rejected=r["terms"],
            bias_chosen=c["bias"],
            bias_rejected=r["bias"],
            reward_chosen=c["reward"],
            reward_rejected=r["reward"],
            heads_chosen=c.get("heads"),
            heads_rejected=r.get("heads"),
            head_bias_chosen=c.get("head_bias"),
            head_bias_rejected=r.get("head_bias"),
            neurons_chosen=c.get("neurons"),
            neurons_rejected=r.get("neurons"),
            neuron_bias_chosen=c.get("neuron_bias"),
            neuron_bias_rejected=r.get("neuron_bias"),
        )

    def finish(self, model, pieces, pair_ids) -> AttributionResult:
        result = super().finish(model, pieces, pair_ids)
        check_identity(model, result)
        return result


def check_identity(model, result: AttributionResult) -> None:
    """Warn when the terms miss the model's reward by more than the dtype's rounding allowance."""
    err = result.max_relative_error()
    tol = CHECK_RTOL.get(model.cfg.dtype, 5e-2)
    if err > tol:
        warnings.warn(
            f"the attribution terms miss the model's reward by up to {err:.2e} relative (more than "
            f"{tol:g}, the rounding allowance of {model.cfg.dtype}); this reward head is not linear in "
            "the final residual along model.reward_direction(_for), so the terms are not exact",
            stacklevel=2,
        )


@checked_arguments(counts={"batch_size": 1}, flags=("neurons",))
def attribute(
    model,
    pairs,
    *,
    heads: Optional[bool] = None,
    neurons: bool = False,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = True,
) -> AttributionResult:
    """Exact direct attribution of each pair's chosen reward, rejected reward and gap.

    Terms: embed, attn_L{l}, mlp_L{l} (sum to reward - bias), per head (with each layer's b_O term they
    sum to attn_L{l}), and with `neurons=True` per MLP neuron (with b_out they sum to mlp_L{l}). The
    identity is checked on every call; a head that is not linear in the final residual gets a warning.
    heads=None: per-head terms when the model has per-head hooks (native architectures).
    """
    check_model(model, "attribute")
    return run_spec(
        model,
        pairs,
        AttributionSpec(heads, neurons),
        batch_size=batch_size,
        padding_side=padding_side,
        progress=progress and "attribute",
    )
