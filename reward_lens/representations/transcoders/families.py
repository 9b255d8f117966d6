"""The activation families of a transcoder, behind one registry: how pre-activations become sparse feature
activations at inference (`activate`) and during training (`train_activate`).

- `topk`: the k largest pre-activations of each token, ReLU'd (Gao et al. 2024), at training and inference.
- `batchtopk`: in training, the k * n largest pre-activations over a batch of n tokens (Bussmann et al.
  2024, "BatchTopK sparse autoencoders"; ties at the threshold all kept); at inference a JumpReLU at one
  threshold, the running mean of the smallest selected activation during training, so a token's L0 varies
  around k.
- `jumprelu`: pre * (pre > threshold) with one threshold per feature, at inference only: the form
  circuit-tracer and SAELens load (`formats`), and what a TopK set becomes through
  `formats.jumprelu_from_topk` (thresholds calibrated on text).
"""

from __future__ import annotations

from typing import Dict, Type

import torch


class Family:
    """One activation rule: `activate(pre, threshold)` at inference, `train_activate(pre, k)` in training."""

    name = ""
    trainable = True

    @staticmethod
    def activate(pre: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def train_activate(pre: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError


class TopK(Family):
    name = "topk"

    @staticmethod
    def activate(pre: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
        values, indices = pre.topk(k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())

    train_activate = staticmethod(lambda pre, k: TopK.activate(pre, k, None))


class BatchTopK(Family):
    name = "batchtopk"

    @staticmethod
    def activate(pre: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
        return pre.relu() * (pre > threshold.to(pre.dtype))

    @staticmethod
    def train_activate(pre: torch.Tensor, k: int) -> torch.Tensor:
        """Every pre-activation at least the batch's (k * n)-th largest, ReLU'd: ties at the threshold
        (a token drawn twice) are all kept, so the selection does not depend on topk's order and a
        data-parallel run's global threshold selects the same entries."""
        flat = pre.reshape(-1)
        threshold = flat.detach().topk(min(k * pre.shape[0], flat.numel())).values[-1]
        return BatchTopK.select(pre, threshold)

    @staticmethod
    def select(pre: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        """The pre-activations at or above `threshold`, ReLU'd; zeros elsewhere."""
        return pre.relu() * (pre >= threshold)


class JumpReLU(Family):
    name = "jumprelu"
    trainable = False

    @staticmethod
    def activate(pre: torch.Tensor, k: int, threshold: torch.Tensor) -> torch.Tensor:
        return pre * (pre > threshold.to(pre.dtype))

    @staticmethod
    def train_activate(pre: torch.Tensor, k: int) -> torch.Tensor:
        raise ValueError(
            "jumprelu transcoders are not trained here; train kind='topk' or 'batchtopk' and convert with "
            "reward_lens.representations.transcoders.jumprelu_from_topk"
        )


FAMILIES: Dict[str, Type[Family]] = {f.name: f for f in (TopK, BatchTopK, JumpReLU)}


def family(name: str) -> Type[Family]:
    """The family called `name`; a one-line error listing the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown transcoder family {name!r}; use one of {sorted(FAMILIES)}")
    return FAMILIES[name]
