"""Validation of model inputs and outputs at the one boundary every forward passes through.

`check_model_inputs` runs at the model's forward entry (and `run_with_cache(readout_only=True)`), so every
instrument's inputs are checked once: token ids are integers in [0, d_vocab) (a -1 would silently read the
last embedding row), masks are binary, of the ids' shape, with no all-zero row, and no longer than n_ctx.
`check_finite_rewards` stops a run at the first non-finite reward, naming the pair and side.
`safe_ratio` is the NaN-not-inf division every normalised quantity uses (a tie has a zero gap).
`as_index` takes an index argument (a quantile, an objective, a step, a token id) only as an integer: a
float would be truncated to another index without a word. `as_count` does the same for a count (a size, a
number of nodes, paths, steps): a negative one would otherwise be taken as a slice (`[:-1]`: all but one).
`as_flag` takes a flag only as a bool: the string 'no' is truthy. `checked_arguments` applies both to a
public function's named arguments before it runs.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np
import torch

from reward_lens.stats import zero_gaps


def as_index(
    value: Any, what: str, size: Optional[int] = None, negative: bool = False, hint: str = ""
) -> int:
    """`value` as an int index (a Python / numpy / 0-d tensor integer, not a bool or a float), in
    [0, size) (or [-size, size) with `negative`) when `size` is given; a one-line error otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"{what} must be an integer index, got {value!r} ({type(value).__name__}){hint}; an index is "
            "never rounded"
        )
    i = int(value)
    low = -size if (negative and size is not None) else 0
    if size is not None and not low <= i < size:
        span = f"{low}..{size - 1}" if size > 0 else "none (it is empty)"
        raise ValueError(f"{what} {i} out of range: valid indices are {span}{hint}")
    if size is None and not negative and i < 0:
        raise ValueError(f"{what} must be >= 0, got {i}{hint}")
    return i


def as_count(
    value: Any, what: str, minimum: int = 1, allow_none: bool = False, hint: str = ""
) -> Optional[int]:
    """`value` as an int count >= `minimum` (a Python / numpy integer; not a bool, a float, a str); None
    only with `allow_none`. A one-line ValueError otherwise: a count is never rounded nor read as a slice."""
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        none = " or None" if allow_none else ""
        raise ValueError(
            f"{what} must be an integer >= {minimum}{none}, got {value!r} ({type(value).__name__}){hint}"
        )
    if int(value) < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {int(value)}{hint}")
    return int(value)


def as_flag(value: Any, what: str) -> bool:
    """`value` as a bool (Python or numpy); a one-line ValueError for anything else (the string 'no' is
    truthy, 0/1 are counts)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def memory_budget() -> Optional[int]:
    """Bytes this process may still allocate on the host: the available memory (/proc/meminfo's
    MemAvailable), capped by an address-space or data limit (`ulimit -v`, RLIMIT_AS / RLIMIT_DATA) less
    what the process already maps; None where neither is known."""
    budget: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    budget = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        used = 0
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
        for limit in (resource.RLIMIT_AS, getattr(resource, "RLIMIT_DATA", resource.RLIMIT_AS)):
            soft = resource.getrlimit(limit)[0]
            if soft != resource.RLIM_INFINITY and soft > 0:
                left = max(0, soft - used)
                budget = left if budget is None else min(budget, left)
    except (ImportError, OSError, ValueError):
        pass
    return budget


def check_memory(nbytes: float, what: str, hint: str) -> None:
    """Refuse, before any work, a job whose estimated host allocation (`nbytes`) exceeds what this process
    may allocate (`memory_budget`): a one-line error instead of the kernel's kill or a bare allocator
    error."""
    budget = memory_budget()
    if budget is not None and nbytes > budget:
        raise MemoryError(
            f"{what} would allocate about {nbytes / 2**30:.1f} GiB, more than the "
            f"{budget / 2**30:.1f} GiB this process may still use; {hint}"
        )


F = TypeVar("F", bound=Callable[..., Any])


def checked_arguments(
    counts: Optional[Mapping[str, int]] = None, flags: Sequence[str] = ()
) -> Callable[[F], F]:
    """Check the named arguments of the decorated function before it runs: each of `counts` (name ->
    minimum) by `as_count` (None allowed where the default is None or the type Optional), each of `flags`
    by `as_flag`."""
    counts = dict(counts or {})

    def wrap(fn: F) -> F:
        sig = inspect.signature(fn)
        missing = [n for n in [*counts, *flags] if n not in sig.parameters]
        if missing:
            raise TypeError(f"{fn.__qualname__} has no argument {missing[0]!r}")
        who = fn.__qualname__

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # Python's own message for a wrong call
            given = bound.arguments
            for name, minimum in counts.items():
                if name in given:
                    param = sig.parameters[name]
                    none = param.default is None or "Optional" in str(param.annotation)
                    given[name] = as_count(given[name], f"{who}: {name}", minimum, allow_none=none)
            for name in flags:
                if name in given:
                    given[name] = as_flag(given[name], f"{who}: {name}")
            return fn(*bound.args, **bound.kwargs)

        run.checked_arguments = (*counts, *flags)  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


def check_name_list(name: str, given: Any, example: str = "['L0H1']") -> None:
    """An optional list of node names: None (all) or a non-empty list; an empty one is refused, never
    widened to all."""
    if given is not None and (isinstance(given, str) or len(given) == 0):
        raise ValueError(
            f"{name}={given!r}: give a non-empty list of names (e.g. {example}), or None for all"
        )


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray) or (
        isinstance(value, (list, tuple)) and not any(isinstance(v, str) for v in value)
    ):
        try:
            return torch.as_tensor(np.asarray(value))
        except (ValueError, TypeError):
            raise ValueError(
                f"{name} is a ragged or non-numeric list; pad it to a rectangle or use model.to_tokens"
            ) from None
    if isinstance(value, (str, list, tuple)):
        raise TypeError(f"{name} is text; tokenise it first with model.to_tokens(prompts, responses)")
    raise TypeError(f"{name} must be a tensor of token ids [batch, pos], got {type(value).__name__}")


def check_token_ids(model, input_ids: Any, name: str = "input_ids") -> torch.Tensor:
    """Token ids as a [batch, pos] integer tensor with every id in [0, d_vocab), no longer than n_ctx."""
    ids = _as_tensor(input_ids, name)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integer token ids, got dtype {ids.dtype}; residual inputs need start_at_layer"
        )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"{name} must be [batch, pos] (or [pos]), got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(ids.shape)}); give at least one token per sequence")
    lo, hi = int(ids.min()), int(ids.max())
    vocab = model.cfg.d_vocab
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{name} holds token id {bad}, outside the model's vocabulary [0, {vocab}); check the "
            "tokenizer matches the model"
        )
    if ids.shape[1] > model.cfg.n_ctx:
        raise ValueError(
            f"{name} has {ids.shape[1]} positions, beyond the model's context n_ctx={model.cfg.n_ctx}; "
            "truncate it (model.to_tokens cuts from the left with max_length)"
        )
    return ids.long() if ids.dtype != torch.long else ids


def check_attention_mask(
    mask: Any, shape: Tuple[int, ...], name: str = "attention_mask", values: bool = True
) -> torch.Tensor:
    """A binary [batch, pos] mask of the ids' shape with at least one attended token per row
    (`values=False`: the shape only)."""
    mask = _as_tensor(mask, name)
    if mask.dim() == 1 and len(shape) == 2 and shape[0] == 1:
        mask = mask[None]
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but the input is {tuple(shape)}; give one 0/1 per token"
        )
    if not values:
        return mask
    if mask.dtype.is_floating_point and not torch.isfinite(mask).all():
        raise ValueError(f"{name} holds NaN or inf; give 0 (padding) or 1 (token)")
    if not ((mask == 0) | (mask == 1)).all():
        found = sorted({float(v) for v in mask.unique()[:6].tolist()})
        raise ValueError(f"{name} must be binary (0 = padding, 1 = token), found values {found}")
    empty = (mask == 0).all(-1).nonzero().flatten()
    if len(empty):
        raise ValueError(
            f"{name} row {int(empty[0])} is all zeros (no token to read the reward from); drop that row"
        )
    return mask.long()


def check_model_inputs(
    model, input_ids: Any, attention_mask: Any = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(ids, mask) checked and converted (lists/arrays -> tensors, [pos] -> [1, pos])."""
    ids = check_token_ids(model, input_ids)
    if attention_mask is not None:
        attention_mask = check_attention_mask(attention_mask, tuple(ids.shape))
    return ids, attention_mask


def check_model(model: Any, who: str) -> None:
    """`model` is a hooked reward model (a TypeError naming the call and what to pass otherwise)."""
    if not (hasattr(model, "cfg") and hasattr(model, "run_with_cache")):
        raise TypeError(
            f"{who}(model, ...) needs a HookedRewardModel as its first argument, got "
            f"{type(model).__name__}; load one with HookedRewardModel.from_pretrained(...) or "
            "reward_lens.load_demo_model()"
        )


def check_finite_rewards(rewards: torch.Tensor, labels: Optional[Sequence[str]] = None) -> None:
    """Refuse a non-finite reward, naming the sequence (`labels[b]`, e.g. "pair rl-3, chosen")."""
    finite = (
        torch.isfinite(rewards.reshape(rewards.shape[0], -1)).all(-1)
        if rewards.dim()
        else torch.isfinite(rewards)
    )
    if bool(finite.all()):
        return
    b = int((~finite).nonzero().flatten()[0])
    what = labels[b] if labels is not None and b < len(labels) else f"sequence {b} of its batch"
    raise ValueError(
        f"non-finite reward ({float(rewards.reshape(rewards.shape[0], -1)[b, 0])}) for {what}; check the "
        "model's weights and dtype (float16 overflows: try dtype='float32'), and that input's tokens"
    )


ArrayLike = Union[torch.Tensor, np.ndarray]


def safe_ratio(numerator: ArrayLike, denominator: ArrayLike, scale: Optional[float] = None) -> ArrayLike:
    """numerator / gap with NaN (never ±inf or a noise-sized divisor) where the gap is zero up to float
    noise (a tie's gap; `reward_lens.stats.zero_gaps`, `scale` the rewards' size)."""
    if isinstance(numerator, torch.Tensor) or isinstance(denominator, torch.Tensor):
        num, den = torch.as_tensor(numerator), torch.as_tensor(denominator)
        zero = torch.from_numpy(zero_gaps(den, scale)).to(den.device)
        out = num / torch.where(zero, torch.ones_like(den), den)
        return torch.where(zero, torch.full_like(out, float("nan")), out)
    num, den = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)
    zero = zero_gaps(den, scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = num / np.where(zero, 1.0, den)
    return np.where(zero, np.nan, out)
