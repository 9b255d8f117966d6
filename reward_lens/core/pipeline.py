"""One driver over preference pairs: the clean passes of every batch run once and every requested
instrument computes from them.

An instrument is a `Spec`: what it reads from each side's clean run (`reads`: hook names at the readout,
whole, and whole with gradients), a per-batch `step` computing its piece from the shared `Shared`
batch, and `finish` turning the pieces (in pair order) into its result. `run_pipeline` batches the
pairs (a `BatchSize`: fixed, or halved on out-of-memory, each pass recomputed whole), runs ONE
capture per side and batch holding the union of what the specs read (with one backward w.r.t. the
activations, never the weights, when a spec asks for gradients), and hands it to each spec.

Merging: a piece is whatever the spec's `finish` takes; the pieces of every batch of every rank are
gathered to rank 0 in pair order and finished there, one rule for batches and for torchrun ranks
(`merge_results` concatenates per-pair result dataclasses: the default `finish`).

Pre-pass: a spec needing something over all pairs before its step (mean-ablation values, a divergence
reference fit) says so with `pre_reads`. Its pre-step then runs in the first pass, beside the steps of
the specs that need nothing over all pairs; the pre-pieces of every rank are all-gathered and
`pre_finish` sets the spec's state; its step runs in a second pass. The first pass's clean captures are
kept for the second one while they fit in `keep_bytes`; a batch beyond that budget reruns its clean
forward (one more forward per side of that batch): with the budget, a pre-pass costs no forward at all.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from reward_lens.core.autobatch import BatchSize
from reward_lens.core.batching import PairBatch, batches, tokenize_pair_batch
from reward_lens.core.directions import readout_direction
from reward_lens.core.ranks import Ranks, current, to_host
from reward_lens.core.readout import Capture, capture
from reward_lens.data.pairs import as_pairs, pair_labels
from reward_lens.model.frozen import with_frozen_weights

SIDES = ("chosen", "rejected")
CLEAN = "clean passes"  # the timings key of the shared captures
KEEP_BYTES = 2**30  # clean captures kept between a pre-pass and the second pass (default budget)


@dataclass
class Reads:
    """What a spec reads from the clean run of each side: side -> hook names."""

    readout: Dict[str, List[str]] = field(default_factory=dict)
    full: Dict[str, List[str]] = field(default_factory=dict)
    grads: Dict[str, List[str]] = field(default_factory=dict)

    @classmethod
    def both(
        cls, readout: Sequence[str] = (), full: Sequence[str] = (), grads: Sequence[str] = ()
    ) -> "Reads":
        """The same names from both sides."""
        return cls(
            {s: list(readout) for s in SIDES}, {s: list(full) for s in SIDES}, {s: list(grads) for s in SIDES}
        )

    def union(self, other: "Reads") -> "Reads":
        out = Reads()
        for kind in ("readout", "full", "grads"):
            mine, theirs = getattr(self, kind), getattr(other, kind)
            setattr(out, kind, {s: list(dict.fromkeys(mine.get(s, []) + theirs.get(s, []))) for s in SIDES})
        return out


@dataclass
class Shared:
    """One batch of pairs and the clean capture of each side (`caps[side]`), with each side's readout
    direction computed once on demand (ArmoRM's gate costs a forward) and a `memo` of what one step
    computed that another reuses (patching's readout sweeps: `patching.engines.SweepMemo`)."""

    batch: PairBatch
    caps: Dict[str, Capture]
    pair_ids: List[str]
    directions: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    memo: Dict[str, Any] = field(default_factory=dict)  # work one spec's step leaves for another's

    def direction(self, model, side: str) -> Tuple[torch.Tensor, torch.Tensor]:
        if side not in self.directions:
            self.directions[side] = readout_direction(model, self.caps[side].tok)
        return self.directions[side]


class Spec:
    """One instrument requested from `run_pipeline` (see the module docstring); `name` keys its result.
    `step_late`: step in the last pass, beside the specs that needed a pre-pass, because it reads their
    work from the batch's memo (the effect decomposition reads patching's sweep)."""

    name = "spec"
    step_late = False

    def setup(self, model, pairs: Sequence) -> None:
        """Resolve defaults and check options against the model and pairs (before any forward)."""

    def reads(self, model, batch: PairBatch) -> Reads:
        return Reads()

    def needs_pre_pass(self) -> bool:
        """Whether the step needs something over all pairs first (decided from the options alone)."""
        return False

    def pre_reads(self, model, batch: PairBatch) -> Reads:
        """What the pre-pass reads."""
        return Reads()

    def pre_step(self, model, shared: Shared) -> Any:
        return None

    def pre_finish(self, model, pieces: List[Any]) -> None:
        """Set the state the step needs from every batch's pre-piece (all ranks, pair order)."""

    def before_steps(self, model, shared: Shared) -> None:
        """Called for every spec of a pass before any of them steps on `shared` (e.g. to ask the memo for
        what this spec will read from another's work)."""

    def step(self, model, shared: Shared) -> Any:
        raise NotImplementedError

    def finish(self, model, pieces: List[Any], pair_ids: List[str]) -> Any:
        return to_host(merge_results(pieces, pair_ids))


def run_spec(
    model,
    pairs: Sequence,
    spec: Spec,
    *,
    batch_size: Union[int, str, BatchSize] = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
    within: Optional[slice] = None,
) -> Any:
    """One instrument alone, in this process: `run_pipeline(model, pairs, [spec])[spec.name]` (`within`: as
    there, a shard of `pairs`)."""
    out = run_pipeline(
        model,
        pairs,
        [spec],
        batch_size=batch_size,
        ranks=Ranks(),
        padding_side=padding_side,
        progress=progress,
        within=within,
    )
    return out[spec.name]


def merge_results(parts: Sequence[Any], pair_ids: List[str]) -> Any:
    """One result from results over consecutive pair sets: per-pair tensors (first axis) concatenated,
    `pair_ids` set to the whole set's, the rest (sites, options) taken from the first; then the
    result's own `after_merge()` (statistics over all pairs), if it has one."""
    parts = [p for p in parts if p is not None]
    if len(parts) == 1:
        out = (
            dataclasses.replace(parts[0], pair_ids=pair_ids) if _has_field(parts[0], "pair_ids") else parts[0]
        )
    else:
        values = {}
        for f in dataclasses.fields(parts[0]):
            if f.init:
                vs = [getattr(p, f.name) for p in parts]
                values[f.name] = pair_ids if f.name == "pair_ids" else _cat(vs, pair_ids)
        out = type(parts[0])(**values)
    return out.after_merge() if hasattr(out, "after_merge") else out


def _has_field(obj: Any, name: str) -> bool:
    return any(f.name == name and f.init for f in dataclasses.fields(obj))


def _cat(vs: List[Any], pair_ids: List[str]) -> Any:
    first = vs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(vs)
    if isinstance(first, dict) and first and all(isinstance(v, torch.Tensor) for v in first.values()):
        return {k: torch.cat([v[k] for v in vs]) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return merge_results(vs, pair_ids)
    return first  # sites, layers, options: the same in every part


def capture_bytes(caps: Dict[str, Capture]) -> int:
    total = 0
    for cap in caps.values():
        for d in (cap.at_readout, cap.full, cap.grads):
            total += sum(t.numel() * t.element_size() for t in d.values())
    return total


def shared_batch(model, batch: PairBatch, reads: Reads, pair_ids: List[str]) -> Shared:
    """The clean capture of both sides of `batch`: one forward each (and one backward where gradients
    are read)."""
    caps = {
        side: capture(
            model,
            getattr(batch, side),
            reads.readout.get(side, ()),
            reads.full.get(side, ()),
            reads.grads.get(side, ()),
        )
        for side in SIDES
    }
    return Shared(batch, caps, pair_ids[batch.index])


@dataclass
class _Pass:
    """One pass over this rank's pairs: which specs step, which pre-step, what is captured and kept."""

    steps: List[Spec]
    pre: List[Spec]
    extra: List[Spec]  # specs of a later pass whose reads are captured now, to keep the captures
    keep: Optional[Dict[Tuple[int, int], Shared]] = None
    keep_bytes: int = 0
    timings: Optional[Dict[str, float]] = None


def _timed(p: _Pass, key: str, model, fn):
    """fn(), its seconds added to `p.timings[key]` when timings are asked for (the device synchronised)."""
    if p.timings is None:
        return fn()
    cuda = torch.device(model.cfg.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    p.timings[key] = p.timings.get(key, 0.0) + time.perf_counter() - start
    return out


def _run_pass(
    model,
    pairs,
    ids,
    p: _Pass,
    bs: int,
    within: slice,
    padding_side,
    progress,
    kept: Dict[Tuple[int, int], Shared],
    tokenized: Dict[Tuple[int, int], PairBatch],
) -> Tuple[Dict[str, list], Dict[str, list]]:
    steps: Dict[str, list] = {s.name: [] for s in p.steps}
    pres: Dict[str, list] = {s.name: [] for s in p.pre}
    used = 0
    if p.keep is not None:
        p.keep.clear()
    for sl in batches(len(pairs), bs, progress, within):
        key = (sl.start, sl.stop)
        shared = kept.pop(key, None)
        batch = shared.batch if shared is not None else tokenized.get(key)
        if batch is None:  # tokenised once per call: a second pass reuses the first's batches
            batch = tokenized[key] = tokenize_pair_batch(model, pairs[sl], sl, padding_side)
        if shared is None:
            reads = Reads()
            for s in p.steps + p.extra:
                reads = reads.union(s.reads(model, batch))
            for s in p.pre:
                reads = reads.union(s.pre_reads(model, batch))
            shared = _timed(p, CLEAN, model, lambda: shared_batch(model, batch, reads, ids))
        with torch.no_grad():  # the steps read the captures; only a capture itself may need a graph
            for s in p.steps:
                s.before_steps(model, shared)
            for s in p.pre:
                pres[s.name].append(_timed(p, s.name, model, lambda: s.pre_step(model, shared)))
            for s in p.steps:
                steps[s.name].append(_timed(p, s.name, model, lambda: s.step(model, shared)))
        if p.keep is not None:
            size = capture_bytes(shared.caps)
            if used + size <= p.keep_bytes:
                used += size
                p.keep[key] = shared
    return steps, pres


@with_frozen_weights
def run_pipeline(
    model,
    pairs,
    specs: Sequence[Spec],
    *,
    batch_size: Union[int, str, BatchSize] = 8,
    ranks: Optional[Ranks] = None,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
    within: Optional[slice] = None,
    keep_bytes: int = KEEP_BYTES,
    timings: Optional[Dict[str, float]] = None,
) -> Optional[Dict[str, Any]]:
    """Every spec's result over `pairs` (a dict keyed by spec name), the clean passes shared.

    `ranks` (default: the joined torchrun process group, else one process): each rank computes its shard
    (whole batches of the initial batch size) and rank 0 gets the results (None on the others).
    `within`: compute only `pairs[within]` (pre-passes still cover every pair). Cost: one forward per
    side and batch (plus one backward per side where a spec reads gradients); a pre-pass adds none while
    the captures fit in `keep_bytes`, else one forward per side of each batch beyond it. `timings`: a dict
    filled with seconds per spec name (its pre-steps and steps) and under "clean passes" (the captures).
    """
    pairs = as_pairs(pairs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"two specs share a name in {names}; give each a distinct name")
    ranks = ranks or current()
    batch = BatchSize.parse(batch_size, model.cfg.device)
    ids = pair_labels(pairs)
    for s in specs:
        s.setup(model, pairs)
    shard = ranks.shard(len(pairs), batch.initial) if ranks.distributed else (within or slice(0, len(pairs)))
    pre_span = shard if ranks.distributed else slice(0, len(pairs))
    late = [s for s in specs if s.needs_pre_pass()]
    # A pre-pass over more pairs than the shard (`within`) batches differently: every spec then steps later.
    if not late:
        early = list(specs)
    else:
        early = [s for s in specs if s not in late and not s.step_late] if pre_span == shard else []
    late = [s for s in specs if s not in early]
    kept: Dict[Tuple[int, int], Shared] = {}
    tokenized: Dict[Tuple[int, int], PairBatch] = {}
    pieces: Dict[str, list] = {}
    if any(s.needs_pre_pass() for s in late):
        first = _Pass(
            early,
            [s for s in late if s.needs_pre_pass()],
            late,
            keep={},
            keep_bytes=keep_bytes,
            timings=timings,
        )
        steps, pres = batch.run(
            lambda bs: _run_pass(
                model,
                pairs,
                ids,
                first,
                bs,
                pre_span,
                padding_side,
                progress and "pipeline (first pass)",
                {},
                tokenized,
            )
        )
        gathered = ranks.all_gather(to_host(pres)) if ranks.distributed else [pres]
        for s in first.pre:
            s.pre_finish(model, [p for part in gathered for p in part[s.name]])
        pieces.update(steps)
        kept = first.keep
        early = late
    steps, _ = batch.run(
        lambda bs: _run_pass(
            model,
            pairs,
            ids,
            _Pass(early, [], [], timings=timings),
            bs,
            shard,
            padding_side,
            progress and "pipeline",
            kept,
            tokenized,
        )
    )
    pieces.update(steps)
    parts = ranks.gather(to_host(pieces)) if ranks.distributed else [pieces]
    if not ranks.is_main:
        return None
    done = ids if ranks.distributed else ids[shard]
    return {s.name: s.finish(model, [p for part in parts for p in part[s.name]], done) for s in specs}
