"""Data-parallel sweeps: the pair-level instruments over the processes of a `torchrun` launch.

Under `torchrun --nproc_per_node K ...` (or `python -m torch.distributed.run`) every process runs the same
program; `Ranks.from_env()` joins the process group and each rank computes on its own device
(`cuda:LOCAL_RANK` when CUDA is used, else the CPU). The group uses gloo even on GPUs: only results cross
processes (a few floats per pair and site), never activations.

The functions here take the arguments of `reward_lens.instruments`' functions of the same name plus
`ranks`, and return what they return on rank 0 (None on the other ranks):

- the pairs are cut into contiguous runs of whole batches (`Ranks.shard`), so every batch is padded and
  computed exactly as in a one-process call and the merged result equals it (up to the order of float
  sums in reductions over all pairs, ~1e-7 relative);
- what is computed over all pairs before a sweep is reduced over ranks first: mean-ablation values
  (`site_means`: float64 sums and counts added up), the divergence reference fit (the clean states
  gathered, in pair order, and fitted alike on every rank);
- every function is one call of the pipeline (`reward_lens.core.pipeline.run_pipeline`) with `ranks`; `run`
  requests several instruments at once, their clean passes shared;
- per-pair results are gathered to rank 0 and concatenated in pair order (`merge`); statistics over pairs
  are computed there on the full set (the divergence threshold here; faithfulness CIs, probes and the
  rest by the caller on the merged results), never averaged over ranks.

With one process (no torchrun) every function is the plain instrument. `batch_size` may be a
`reward_lens.core.autobatch.BatchSize` (`"auto"`): a rank that runs out of memory halves its own batches
and recomputes its shard; the shards (cut in units of the initial size) stay the same on every rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from reward_lens.core.autobatch import BatchSize
from reward_lens.core.pipeline import Spec, merge_results, run_pipeline
from reward_lens.core.ranks import Ranks, current, to_host  # noqa: F401  (part of this module's API)
from reward_lens.data.pairs import as_pairs
from reward_lens.instruments import divergence as div_mod
from reward_lens.instruments.attribution import AttributionSpec
from reward_lens.instruments.lens import LensSpec
from reward_lens.instruments.patching import atp as atp_mod
from reward_lens.instruments.patching import contrastive

Batch = Union[int, str, BatchSize]


def merge(parts: Sequence[Any], pair_ids: List[str]) -> Any:
    """One result from per-shard results in pair order (`reward_lens.core.pipeline.merge_results`: per-pair
    tensors concatenated, statistics over all pairs such as a divergence threshold recomputed)."""
    return merge_results(parts, pair_ids)


def run(
    model,
    pairs,
    specs: Sequence[Spec],
    *,
    ranks: Optional[Ranks] = None,
    batch_size: Batch = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> Optional[Dict[str, Any]]:
    """Several instruments over ranks, their clean passes shared (`run_pipeline`); rank 0: the results."""
    return run_pipeline(
        model,
        pairs,
        specs,
        batch_size=batch_size,
        ranks=ranks or current(),
        padding_side=padding_side,
        progress=progress,
    )


def _one(model, pairs, spec: Spec, ranks, batch_size: Batch, options: Dict[str, Any]) -> Any:
    """One instrument's spec over ranks: its result on rank 0, None on the others."""
    out = run(
        model,
        pairs,
        [spec],
        ranks=ranks,
        batch_size=batch_size,
        padding_side=options.get("padding_side"),
        progress=options.get("progress", False),
    )
    return None if out is None else out[spec.name]


def _pop(options: Dict[str, Any], *names: str) -> Dict[str, Any]:
    """The spec's options: `options` without the driver's own (batching, padding, progress)."""
    return {k: v for k, v in options.items() if k not in ("padding_side", "progress") + names}


def lens(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.lens` over ranks (rank 0: the LensResult of all pairs)."""
    return _one(model, pairs, LensSpec(**_pop(options)), ranks, batch_size, options)


def attribute(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.attribute` over ranks (rank 0: the AttributionResult of all pairs)."""
    return _one(model, pairs, AttributionSpec(**_pop(options)), ranks, batch_size, options)


def site_means(
    model,
    pairs,
    sites,
    positions: str = "readout",
    *,
    ranks: Optional[Ranks] = None,
    batch_size: Batch = 8,
    padding_side: Optional[str] = None,
) -> Dict[str, torch.Tensor]:
    """Mean-ablation values over all pairs (every rank gets them): float64 sums and counts of each
    rank's shard, added up over ranks."""
    pairs = as_pairs(pairs)
    ranks = ranks or current()
    batch = BatchSize.parse(batch_size, model.cfg.device)
    sl = ranks.shard(len(pairs), batch.initial) if ranks.distributed else slice(0, len(pairs))
    local: Any = ({}, 0)
    if sl.stop > sl.start:
        local = to_host(
            batch.run(
                lambda bs: contrastive.site_sums(
                    model, pairs[sl], sites, positions, batch_size=bs, padding_side=padding_side
                )
            )
        )
    sums, count = contrastive.add_sums(ranks.all_gather(local))
    return contrastive.means_from_sums(model, sites, sums, count)


def patch(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.patch` over ranks; mean ablation uses the means over all pairs."""
    spec = contrastive.PatchSpec(**_pop(options), name="patch")
    return _one(model, pairs, spec, ranks, batch_size, options)


def attribution_patch(
    model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options
) -> Any:
    """`reward_lens.instruments.attribution_patch` (AtP) over ranks; mean ablation over all pairs."""
    return _one(model, pairs, atp_mod.AtPSpec(**_pop(options), name="atp"), ranks, batch_size, options)


def divergence_patch(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.divergence_patch` over ranks: the reference fit on all pairs' clean states
    (gathered in pair order), swaps with the next pair of all pairs, the threshold over all pairs' swaps."""
    return _one(model, pairs, div_mod.DivergenceSpec(**_pop(options)), ranks, batch_size, options)
