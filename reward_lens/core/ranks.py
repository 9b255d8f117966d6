"""This process's place in a data-parallel (torchrun) run, and moving results to the host to cross
processes. Only results cross processes (a few floats per pair and site), never activations, so the
group uses gloo even on GPUs."""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any, List, Optional

import torch


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
        """From torchrun's WORLD_SIZE / RANK / LOCAL_RANK, joining the (gloo) process group; one rank
        otherwise."""
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
        return dataclasses.replace(
            obj, **{f.name: to_host(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    return obj
