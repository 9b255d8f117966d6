"""What crosses the ranks when transcoders train data-parallel (`train_transcoders` under `torchrun`, or any
joined process group): every rank keeps the same parameters and draws the same random numbers, computes the
model forwards of its own share of the text batches, and the step is the one-process step on the union of
the ranks' rows:

- the buffer: text batches go to ranks in turn; a buffer slot belongs to the rank that computed its row,
  and the first buffer (the target scale, the skip's least-squares start) is assembled whole on every rank;
- the loss: each rank's sums over its rows divided by the global row count, gradients summed over ranks;
- dead latents: a feature fired when it fired on any rank; every rank counts the global rows;
- BatchTopK: the k * n largest pre-activations over every rank's rows (each rank's top k * n gathered),
  and its running threshold from the global smallest selected activation.

Collectives run on the CPU under gloo and on the rank's GPU under nccl (tensors are moved for the call).
"""

from __future__ import annotations

from typing import Optional

import torch

from reward_lens.core.ranks import Ranks, current


class TrainingGroup:
    """This process's rank in data-parallel transcoder training, and the collectives the training uses."""

    def __init__(self, ranks: Ranks):
        self.rank, self.world_size, self.ranks = ranks.rank, ranks.world_size, ranks

    @classmethod
    def joined(cls) -> Optional["TrainingGroup"]:
        """The group of an initialised process group with more than one rank; None otherwise."""
        ranks = current()
        return cls(ranks) if ranks.distributed else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, chunk: int) -> bool:
        """Whether text batch number `chunk` (counted over the whole run) is this rank's to compute."""
        return chunk % self.world_size == self.rank

    def _device(self, t: torch.Tensor) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu") if t.device.type != "cuda" else t.device

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`t` reduced over ranks (sum, min or max), in place; returned for chaining."""
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dev = self._device(t)
        buf = t if t.device == dev else t.to(dev)
        dist.all_reduce(buf, op=ops[op])
        if buf is not t:
            t.copy_(buf)
        return t

    def sum_gradients(self, tensors) -> None:
        """Each tensor's .grad summed over ranks, in place (zeros where a rank has none)."""
        for v in tensors:
            if v.grad is None:
                v.grad = torch.zeros_like(v)
            self.all_reduce(v.grad)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world_size, *t.shape]: every rank's `t` (equal shapes on every rank), in rank order."""
        import torch.distributed as dist

        dev = self._device(t)
        buf = t.to(dev).contiguous()
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(out, buf)
        return torch.stack(out).to(t.device)

    def assemble(self, local: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        """The whole buffer [n_slots, ...] in slot order from every rank's rows (`slot_rows[s]`: this
        rank's row of slot s, -1 where another rank holds it). Exact: each slot is one rank's value
        plus zeros."""
        whole = torch.zeros(len(slot_rows), *local.shape[1:], dtype=local.dtype, device=local.device)
        mine = slot_rows >= 0
        whole[mine.to(local.device)] = local[slot_rows[mine].to(local.device)]
        return self.all_reduce(whole)

    def batch_threshold(self, pre: torch.Tensor, m: int) -> torch.Tensor:
        """The m-th largest value of `pre` over every rank's rows (-inf when there are fewer): BatchTopK's
        selection over the global batch, from each rank's own m largest."""
        flat = pre.detach().reshape(-1)
        top = flat.topk(min(m, flat.numel())).values
        padded = torch.full((m,), float("-inf"), dtype=pre.dtype, device=pre.device)
        padded[: top.numel()] = top
        every = self.all_gather(padded).reshape(-1)
        return every.topk(m).values[-1]

    def check_same(self, what: dict) -> None:
        """Raise on every rank when the ranks were given different settings or texts."""
        seen = self.ranks.all_gather(what)
        if any(s != seen[0] for s in seen):
            raise ValueError(
                "data-parallel train_transcoders needs the same texts and settings on every rank; got "
                f"{seen[0]} on rank 0 and {next(s for s in seen if s != seen[0])} on another"
            )
