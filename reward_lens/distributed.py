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
- per-pair results are gathered to rank 0 and concatenated in pair order (`merge`); statistics over pairs
  are computed there on the full set (the divergence threshold here; faithfulness CIs, probes and the
  rest by the caller on the merged results), never averaged over ranks.

With one process (no torchrun) every function is the plain instrument. `batch_size` may be a
`reward_lens.core.autobatch.BatchSize` (`"auto"`): a rank that runs out of memory halves its own batches
and recomputes its shard; the shards (cut in units of the initial size) stay the same on every rank.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from reward_lens.core.autobatch import BatchSize
from reward_lens.data.pairs import as_pairs, pair_labels
from reward_lens.instruments import divergence as div_mod
from reward_lens.instruments.attribution import attribute as attribute_instrument
from reward_lens.instruments.lens import lens as lens_instrument
from reward_lens.instruments.patching import atp as atp_mod
from reward_lens.instruments.patching import contrastive
from reward_lens.instruments.sites import sites_for

Batch = Union[int, str, BatchSize]


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> "Ranks":
        """From torchrun's WORLD_SIZE / RANK / LOCAL_RANK, joining the (gloo) process group; one rank otherwise."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        import torch.distributed as dist

        if not dist.is_initialized():  # ranks wait for each other at gathers: allow long uneven steps
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(hours=2))
        return cls(rank, world, local)

    def device(self, requested: Optional[str]) -> Optional[str]:
        """This rank's device: `cuda:LOCAL_RANK` for a requested (or, with CUDA present, default) cuda device
        in a multi-process run; the request unchanged otherwise."""
        if not self.distributed or not torch.cuda.is_available():
            return requested
        if requested is None or torch.device(requested).type == "cuda":
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return requested

    def shard(self, n: int, unit: int) -> slice:
        """This rank's contiguous part of range(n): whole runs of `unit` items, balanced over ranks."""
        units = -(-n // unit)
        lo, hi = self.rank * units // self.world_size, (self.rank + 1) * units // self.world_size
        return slice(min(n, lo * unit), min(n, hi * unit))

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's `obj` in rank order on rank 0; None on the others."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's `obj` in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


def current() -> Ranks:
    """The Ranks of an already joined process group (one rank when there is none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Ranks()


def to_host(obj: Any) -> Any:
    """`obj` with every tensor (in dataclasses, dicts, lists) on the CPU: what crosses processes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_host(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_host(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if f.init})
    return obj


def merge(parts: Sequence[Any], pair_ids: List[str]) -> Any:
    """One result from per-shard results in pair order: per-pair tensors (first axis) concatenated,
    `pair_ids` set to the full set's, the rest (sites, options) taken from the first; a divergence
    threshold recomputed over all pairs' clean swaps."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        return dataclasses.replace(parts[0], pair_ids=pair_ids) if _has_field(parts[0], "pair_ids") else parts[0]
    first = parts[0]
    values = {}
    for f in dataclasses.fields(first):
        if not f.init:
            continue
        vs = [getattr(p, f.name) for p in parts]
        values[f.name] = pair_ids if f.name == "pair_ids" else _cat(vs, pair_ids)
    out = type(first)(**values)
    if isinstance(out, div_mod.DivergenceResult):
        out.threshold = div_mod.calibrated_threshold(out.calibration_scores, out.settings["quantile"])
    return out


def _has_field(obj: Any, name: str) -> bool:
    return any(f.name == name and f.init for f in dataclasses.fields(obj))


def _cat(vs: List[Any], pair_ids: List[str]) -> Any:
    first = vs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(vs)
    if isinstance(first, dict) and first and all(isinstance(v, torch.Tensor) for v in first.values()):
        return {k: torch.cat([v[k] for v in vs]) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return merge(vs, pair_ids)
    return first  # sites, layers, options: the same on every rank


def _options(fn: Callable, options: Dict[str, Any]) -> inspect.BoundArguments:
    """`options` bound to `fn`'s keyword arguments with its defaults filled in (what the call will use)."""
    bound = inspect.signature(fn).bind_partial(None, None, **options)
    bound.apply_defaults()
    return bound


def _run(fn: Callable, model, pairs, ranks: Optional[Ranks], batch_size: Batch, options: Dict[str, Any]) -> Any:
    """`fn(model, pairs[shard], batch_size=..., **options)` on each rank, merged on rank 0."""
    pairs = as_pairs(pairs)
    ranks = ranks or current()
    batch = BatchSize.parse(batch_size, model.cfg.device)
    if not ranks.distributed:
        return batch.run(lambda bs: fn(model, pairs, batch_size=bs, **options))
    sl = ranks.shard(len(pairs), batch.initial)
    part = None
    if sl.stop > sl.start:
        part = to_host(batch.run(lambda bs: fn(model, pairs[sl], batch_size=bs, **options)))
    parts = ranks.gather(part)
    return merge(parts, pair_labels(pairs)) if ranks.is_main else None


def lens(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.lens` over ranks (rank 0: the LensResult of all pairs)."""
    return _run(lens_instrument, model, pairs, ranks, batch_size, options)


def attribute(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.attribute` over ranks (rank 0: the AttributionResult of all pairs)."""
    return _run(attribute_instrument, model, pairs, ranks, batch_size, options)


def site_means(model, pairs, sites, positions: str = "readout", *, ranks: Optional[Ranks] = None,
               batch_size: Batch = 8, padding_side: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Mean-ablation values over all pairs (every rank gets them): float64 sums and counts of each
    rank's shard, added up over ranks."""
    pairs = as_pairs(pairs)
    ranks = ranks or current()
    batch = BatchSize.parse(batch_size, model.cfg.device)
    sl = ranks.shard(len(pairs), batch.initial) if ranks.distributed else slice(0, len(pairs))
    local: Any = ({}, 0)
    if sl.stop > sl.start:
        local = to_host(batch.run(lambda bs: contrastive.site_sums(
            model, pairs[sl], sites, positions, batch_size=bs, padding_side=padding_side)))
    sums: Dict[str, torch.Tensor] = {}
    count = 0
    for part_sums, part_count in ranks.all_gather(local):
        for h, v in part_sums.items():
            sums[h] = sums[h] + v if h in sums else v
        count += part_count
    return contrastive.means_from_sums(model, sites, sums, count)


def _with_means(fn: Callable, model, pairs, ranks, batch_size: Batch, options: Dict[str, Any], level) -> Dict[str, Any]:
    """`options` with mean-ablation values over all pairs added when a mode needs them."""
    args = _options(fn, options).arguments
    modes = [args["mode"]] if isinstance(args["mode"], str) else list(args["mode"])
    if "mean" in modes and args["means"] is None:
        sites = sites_for(model.cfg, level, args["layers"])
        means = site_means(model, pairs, sites, args["positions"] if "positions" in args else "readout",
                           ranks=ranks, batch_size=batch_size, padding_side=args["padding_side"])
        options = {**options, "means": means}
    return options


def patch(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.patch` over ranks; mean ablation uses the means over all pairs."""
    pairs, ranks = as_pairs(pairs), ranks or current()
    level = _options(contrastive.patch, options).arguments["level"]
    options = _with_means(contrastive.patch, model, pairs, ranks, batch_size, options, level)
    return _run(contrastive.patch, model, pairs, ranks, batch_size, options)


def attribution_patch(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.attribution_patch` (AtP) over ranks; mean ablation over all pairs."""
    pairs, ranks = as_pairs(pairs), ranks or current()
    level = _options(atp_mod.attribution_patch, options).arguments["level"]
    if level is None:  # the instrument's default
        level = ("component", "head") if model.has_head_hooks else "component"
    options = _with_means(atp_mod.attribution_patch, model, pairs, ranks, batch_size, options, level)
    return _run(atp_mod.attribution_patch, model, pairs, ranks, batch_size, options)


def divergence_patch(model, pairs, *, ranks: Optional[Ranks] = None, batch_size: Batch = 8, **options) -> Any:
    """`reward_lens.instruments.divergence_patch` over ranks: the reference fit on all pairs' clean states
    (gathered in pair order), swaps with the next pair of all pairs, the threshold over all pairs' swaps."""
    pairs, ranks = as_pairs(pairs), ranks or current()
    if not ranks.distributed:
        return _run(div_mod.divergence_patch, model, pairs, ranks, batch_size, options)
    args = _options(div_mod.divergence_patch, options).arguments
    batch = BatchSize.parse(batch_size, model.cfg.device)
    sites = sites_for(model.cfg, args["level"], args["layers"])
    if args["mode"] == "mean" and args["means"] is None:
        options = {**options, "means": site_means(model, pairs, sites, "readout", ranks=ranks, batch_size=batch,
                                                  padding_side=args["padding_side"])}
    if args["method"] == "mahalanobis" and args["reference"] is None:
        hooks = [div_mod.state_hook(s, model.cfg.n_layers, args["state"]) for s in sites]
        ref = div_mod.reference_pairs(pairs, args["max_reference"])
        within = ranks.shard(len(ref), batch.initial)
        local = batch.run(lambda bs: div_mod.reference_states(model, ref, hooks, bs, args["padding_side"],
                                                              within=within)) if within.stop > within.start else None
        parts = [p for p in ranks.all_gather(local) if p is not None]
        states = {h: torch.cat([p[h] for p in parts]) for h in parts[0]}
        options = {**options, "reference": div_mod.fit_reference(states, args["n_components"])}
    sl = ranks.shard(len(pairs), batch.initial)
    part = None
    if sl.stop > sl.start:
        part = to_host(batch.run(lambda bs: div_mod.divergence_patch(model, pairs, batch_size=bs, shard=sl, **options)))
    parts = ranks.gather(part)
    return merge(parts, pair_labels(pairs)) if ranks.is_main else None
