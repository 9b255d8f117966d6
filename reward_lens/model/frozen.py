"""Weights frozen for the library's own instruments.

A loaded model's parameters require gradients, as TransformerLens's do, so TL's gradient tools
(`attribution_patch`, `faithfulness`, a demo's `value.backward()`) run straight after loading. The
library's instruments take gradients with respect to activations only: inside `frozen_weights` no
parameter requires a gradient, so a forward records no weight-gradient graph (no activation is kept for a
weight's gradient) and a backward fills no `.grad`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import torch.nn as nn

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def frozen_weights(module: nn.Module) -> Iterator[None]:
    """`module`'s parameters require no gradient for the duration; each one's flag is restored after
    (nested uses and exceptions included)."""
    thawed = [p for p in module.parameters() if p.requires_grad]
    for p in thawed:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in thawed:
            p.requires_grad_(True)


def with_frozen_weights(fn: F) -> F:
    """Decorator: `fn(model, ...)` runs under `frozen_weights(model)` (its first argument)."""

    @functools.wraps(fn)
    def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(model, nn.Module):
            return fn(model, *args, **kwargs)  # the function's own argument check names the problem
        with frozen_weights(model):
            return fn(model, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
