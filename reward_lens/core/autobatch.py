"""Batch sizes that adapt to memory: `--batch-size auto` halves the batch on out-of-memory instead of
crashing.

`BatchSize(n)` is a fixed size; `BatchSize.auto(device)` starts at `AUTO_START[device type]` and, when a
step runs out of memory, frees the allocator's cache, halves the size and reruns the step; later steps
keep the smaller size. A step is one call of `run(fn)` with `fn(batch_size)`, so an interrupted step is
recomputed whole (its batches are never mixed across sizes). At size 1 the error is raised as it is.
"""

from __future__ import annotations

import gc
import warnings
from typing import Callable, Optional, TypeVar, Union

import torch

T = TypeVar("T")
AUTO_START = {"cuda": 32, "mps": 16, "cpu": 8}


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA), or the RuntimeError other backends raise for it."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    if isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class BatchSize:
    """A batch size: fixed, or (`backoff=True`) halved on out-of-memory. `initial` never changes (a
    data-parallel run cuts its shards in units of it, so every rank agrees whatever its own back-offs)."""

    def __init__(self, size: int, backoff: bool = False, echo: Optional[Callable[[str], None]] = None):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"batch size must be an integer >= 1 or 'auto', got {size!r}")
        self.initial = self.size = size
        self.backoff = backoff
        self.echo = echo

    @classmethod
    def auto(
        cls, device: Union[str, torch.device, None] = None, echo: Optional[Callable[[str], None]] = None
    ) -> "BatchSize":
        kind = torch.device(device).type if device is not None else "cpu"
        return cls(AUTO_START.get(kind, 8), backoff=True, echo=echo)

    @classmethod
    def parse(cls, value: Union[int, str, "BatchSize"], device=None, echo=None) -> "BatchSize":
        """An int (fixed), "auto" (start by device, halve on OOM) or a BatchSize (returned as is)."""
        if isinstance(value, BatchSize):
            return value
        if isinstance(value, str) and value.strip().lower() == "auto":
            return cls.auto(device, echo)
        return cls(value)

    def run(self, fn: Callable[[int], T]) -> T:
        """`fn(size)`; on out-of-memory (with back-off) free memory, halve the size and call it again."""
        while True:
            try:
                return fn(self.size)
            except Exception as exc:  # noqa: BLE001 - only out-of-memory is retried; anything else re-raised
                if not (self.backoff and self.size > 1 and is_out_of_memory(exc)):
                    raise
            free_memory()  # outside the except block: the exception's frames (and tensors) are released
            self.size = max(1, self.size // 2)
            message = f"out of memory; retrying with batch size {self.size}"
            if self.echo is not None:
                self.echo(f"[reward-lens] {message}")
            else:
                warnings.warn(message, stacklevel=2)

    def __repr__(self) -> str:
        return f"BatchSize({self.size}{', auto' if self.backoff else ''})"
