"""Weights frozen for the library's own instruments.

A loaded model's parameters require gradients, as TransformerLens's do, so TL's gradient tools
(`attribution_patch`, `faithfulness`, a demo's `value.backward()`) run straight after loading. The
library's instruments take gradients with respect to activations only: inside `frozen_weights` no
parameter requires a gradient, so a forward records no weight-gradient graph (no activation is kept for a
weight's gradient) and a backward fills no `.grad`.

`gradients_on(who)`: the gradient instruments take their gradients inside it, so they work when called
under `torch.no_grad()` (grad re-enabled for their own graph) and refuse, in one line, under
`torch.inference_mode()` (whose tensors can never join a graph).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import torch
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


@contextlib.contextmanager
def gradients_on(who: str, enabled: bool = True) -> Iterator[None]:
    """Gradient recording on for the duration (also inside `torch.no_grad()`); a one-line ValueError inside
    `torch.inference_mode()`, where no gradient can be taken."""
    if enabled:
        check_gradients_possible(who)
    with torch.set_grad_enabled(enabled):
        yield


def check_gradients_possible(who: str) -> None:
    """A one-line ValueError inside `torch.inference_mode()` (checked before any work is done)."""
    if torch.is_inference_mode_enabled():
        raise ValueError(
            f"{who} takes gradients, which torch.inference_mode() forbids: call it outside the "
            "inference_mode block (inside torch.no_grad() is fine: it enables gradients for its own graph)"
        )
