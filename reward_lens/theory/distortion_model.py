"""The distortion index of a model: its readout states on evaluation pairs (one forward per side and batch
through the pipeline, or shared with the audit's) and the dimensions' directions in that space (from a
hacking-probe result's own scoring forward, concept directions, or pairs differing in one dimension).
The index itself: `reward_lens.theory.distortion`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Union

import numpy as np

from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.data.pairs import PreferencePair, as_pairs
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.stats import to_float64
from reward_lens.theory.distortion import DistortionResult, distortion_from_directions


@dataclass
class ReadoutStates:
    """Per pair: `delta` = x(chosen) − x(rejected) with x = resid_final[readout] / ln_final scale, and the
    reward direction `direction` (ArmoRM's prompt-conditioned one per pair), float64 [n, d], so that
    direction · delta is the reward difference exactly."""

    pair_ids: List[str]
    delta: Any
    direction: Any


class StatesSpec(Spec):
    """The readout states of pairs as a pipeline instrument (read from the shared clean passes)."""

    name = "readout_states"

    def reads(self, model, batch) -> Reads:
        return Reads.both(readout=[final_resid_name(model.cfg.n_layers), act_name("final_scale")])

    def step(self, model, shared: Shared) -> ReadoutStates:
        last, scale = final_resid_name(model.cfg.n_layers), act_name("final_scale")
        x = {
            side: cap.at_readout[last].double() / cap.at_readout[scale].reshape(-1, 1).double()
            for side, cap in shared.caps.items()
        }
        w, _ = shared.direction(model, "chosen")  # the gate reads the prompt only: shared by both sides
        return ReadoutStates(shared.pair_ids, x["chosen"] - x["rejected"], w.double())


def readout_states(model, pairs: Any, *, batch_size: int = 8, progress: Union[bool, str] = False):
    """(delta, direction) numpy arrays of `ReadoutStates` (one forward per side and batch)."""
    spec = StatesSpec()
    states = run_spec(model, as_pairs(pairs), spec, batch_size=batch_size, progress=progress)
    return states.delta.numpy(), states.direction.numpy()


def _dimension_specs(dimensions: Any) -> Dict[str, Any]:
    """name -> direction or pairs; a probe-suite result becomes name -> its probe pairs (A = with the
    property)."""
    per_item = getattr(dimensions, "per_item", None)
    if per_item is not None and not isinstance(dimensions, Mapping):
        need = {"dimension", "prompt", "response_a", "response_b"}
        if not need <= set(per_item.columns):
            raise ValueError(
                f"the probe result's per_item frame lacks columns {sorted(need - set(per_item.columns))}"
            )
        deltas = getattr(dimensions, "item_deltas", None)
        if deltas is not None:  # the probe suite's own readout states: each dimension's mean state difference
            dims = per_item["dimension"].to_numpy()
            return {name: deltas[dims == name].mean(0) for name in dict.fromkeys(dims)}
        out: Dict[str, Any] = {}
        for row in per_item.itertuples():
            out.setdefault(row.dimension, []).append(
                PreferencePair(row.prompt, row.response_a, row.response_b)
            )
        return out
    if not isinstance(dimensions, Mapping) or not dimensions:
        raise ValueError(
            "dimensions must be a probe-suite result, or a non-empty dict name -> direction [d_model] or "
            "name -> pairs differing only in that dimension"
        )
    return dict(dimensions)


def _probe_sets(probes: Any) -> Dict[str, Any]:
    """name -> pairs; a list of pairs (or a pairs file) is grouped by its `subset` ("all" when unset)."""
    if isinstance(probes, Mapping):
        if not probes:
            raise ValueError(
                "no evaluation probes given; pass name -> pairs, or a list of pairs with subsets"
            )
        return dict(probes)

    groups: Dict[str, list] = {}
    for p in as_pairs(probes):
        groups.setdefault(getattr(p, "subset", None) or "all", []).append(p)
    return groups


def distortion_from_model(
    model,
    probes: Any,
    dimensions: Any,
    *,
    batch_size: int = 8,
    progress: Union[bool, str] = False,
    states: Optional[ReadoutStates] = None,
    **options: Any,
) -> DistortionResult:
    """The distortion index of evaluation pair sets for `model`.

    `probes`: name -> pairs, or a list of pairs / a pairs file (grouped by `subset`); `states`: the
    `ReadoutStates` of that list, in its order, when already computed (e.g. by the audit's shared passes).
    `dimensions`: a hacking-probe result (`reward_lens.probes.suite.run_probes`: each dimension's probe pairs
    define it), or name -> a concept direction [d_model] in the norm-aware readout space, or name -> pairs
    that differ only in that dimension (chosen = more of it). A dimension given by pairs gets the mean
    readout-state difference of its pairs as its direction. Options as in `distortion_index`.
    """
    specs = _dimension_specs(dimensions)
    U = {}
    for name, spec in specs.items():
        if hasattr(spec, "shape") and len(spec.shape) == 1:
            U[name] = to_float64(spec)
        else:
            delta, _ = readout_states(model, spec, batch_size=batch_size)
            U[name] = delta.mean(0)
    per_probe_w, per_probe_delta = {}, {}
    if states is not None:
        subsets = np.array([getattr(p, "subset", None) or "all" for p in as_pairs(probes)])
        if len(subsets) != len(states.pair_ids):
            raise ValueError(
                f"states hold {len(states.pair_ids)} pairs but probes {len(subsets)}; pass the states of "
                "the same pairs list"
            )
        for p in dict.fromkeys(subsets):
            rows = subsets == p
            per_probe_delta[p], per_probe_w[p] = states.delta.numpy()[rows], states.direction.numpy()[rows]
    else:
        for p, pairs in _probe_sets(probes).items():
            per_probe_delta[p], per_probe_w[p] = readout_states(
                model, pairs, batch_size=batch_size, progress=progress
            )
    return distortion_from_directions(per_probe_w, U, per_probe_delta, **options)
