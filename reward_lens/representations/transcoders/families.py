"""The activation families of a transcoder, behind one registry: how pre-activations become sparse feature
activations at inference (`activate`) and during training (`train_activate`).

- `topk`: the k largest pre-activations of each token, ReLU'd (Gao et al. 2024), at training and inference.
- `batchtopk`: in training, the k * n largest pre-activations over a batch of n tokens (Bussmann et al.
  2024, "BatchTopK sparse autoencoders"); at inference a JumpReLU at one threshold, the running mean of the
  smallest selected activation during training, so a token's L0 varies around k.
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
        flat = pre.reshape(-1)
        values, indices = flat.topk(min(k * pre.shape[0], flat.numel()))
        return torch.zeros_like(flat).scatter(-1, indices, values.relu()).reshape(pre.shape)


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
