"""One truncation warning per call, not one per batch.

`to_tokens` cuts over-long inputs and reports them here. Outside any collector the report is a warning
at once (a direct `to_tokens` call). Inside `one_truncation_warning()` (every instrument's batch loop,
`reward_lens.core.readout.batches`, and the whole audit) reports are collected and one warning is issued
when the outermost collector closes, naming how many distinct inputs were cut.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from typing import Dict, Hashable, Iterable, Iterator, Optional, Set

_local = threading.local()


def _message(n: int, limit: int) -> str:
    return (
        f"{n} input(s) longer than {limit} tokens were truncated from the left (the start is cut; the "
        "end, where the reward is read, is kept); shorten them or pass a larger max_length"
    )


def report_truncation(inputs: Iterable[Hashable], limit: int) -> None:
    """Record inputs (e.g. their rendered texts) cut to `limit` tokens; warn now if no collector is open."""
    cut = set(inputs)
    if not cut:
        return
    pending: Optional[Dict[int, Set[Hashable]]] = getattr(_local, "pending", None)
    if pending is None:
        warnings.warn(_message(len(cut), limit), stacklevel=3)
    else:
        pending.setdefault(limit, set()).update(cut)


@contextmanager
def one_truncation_warning() -> Iterator[None]:
    """Collect truncation reports; on leaving the outermost collector, one warning per token limit."""
    if getattr(_local, "pending", None) is not None:  # nested: the outer collector warns
        yield
        return
    _local.pending = {}
    try:
        yield
    finally:
        pending, _local.pending = _local.pending, None
        for limit, cut in sorted(pending.items()):
            warnings.warn(_message(len(cut), limit), stacklevel=3)
