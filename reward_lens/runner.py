"""The one batching and readout-gathering helper every instrument shares.

Instruments never write hook plumbing of their own: they ask for rewards and readout-position
activations of (prompt, response) lists here, in batches, with a progress bar on long runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


@dataclass
class Tokenized:
    input_ids: torch.Tensor  # [batch, pos]
    attention_mask: torch.Tensor  # [batch, pos]
    readout: torch.Tensor  # [batch] readout position of each row


@dataclass
class ReadoutRun:
    """Rewards and activations at the readout position of each sequence, concatenated over batches.

    `acts[name]` has the readout position squeezed out: [n, d_model] for residual hooks, [n, n_heads,
    d_head] for hook_z, [n, 1] for ln_final.hook_scale, [n, n_heads, key_pos] for patterns (padded).
    """

    rewards: torch.Tensor  # [n] or [n, n_outputs]
    acts: Dict[str, torch.Tensor]


def tokenize(model, prompts: Sequence[str], responses: Sequence[str], padding_side: Optional[str] = None) -> Tokenized:
    batch = model.to_tokens(list(prompts), list(responses), padding_side=padding_side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


def batches(n: int, batch_size: int, progress: Union[bool, str] = False) -> Iterator[slice]:
    """Slices covering range(n) in chunks; a tqdm bar when `progress` (a str is its label)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, n, batch_size)
    if progress and n > batch_size:
        starts = tqdm(starts, desc=progress if isinstance(progress, str) else None, leave=False)
    for s in starts:
        yield slice(s, min(n, s + batch_size))


@torch.no_grad()
def readout_run(
    model,
    prompts: Sequence[str],
    responses: Sequence[str],
    names_filter: NamesFilter = None,
    *,
    batch_size: int = 8,
    progress: Union[bool, str] = False,
) -> ReadoutRun:
    """Rewards of every (prompt, response) and the named activations at each readout position."""
    rewards: List[torch.Tensor] = []
    acts: Dict[str, List[torch.Tensor]] = {}
    for sl in batches(len(prompts), batch_size, progress):
        tok = tokenize(model, prompts[sl], responses[sl])
        out, cache = model.run_with_cache(
            tok.input_ids, attention_mask=tok.attention_mask, readout_only=True,
            readout_positions=tok.readout, names_filter=names_filter if names_filter is not None else (lambda n: False),
        )
        rewards.append(out.detach())
        for name, value in cache.items():
            is_query_axis_2 = name.endswith(("hook_attn_scores", "hook_pattern"))
            if value.dim() >= 3:
                value = value[:, :, 0] if is_query_axis_2 else value[:, 0]
            acts.setdefault(name, []).append(value)
    return ReadoutRun(torch.cat(rewards), {k: _cat_padded(v) for k, v in acts.items()})


def _cat_padded(chunks: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding a trailing key axis that differs between batches."""
    if all(c.shape[1:] == chunks[0].shape[1:] for c in chunks):
        return torch.cat(chunks)
    width = max(c.shape[-1] for c in chunks)
    return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1])) for c in chunks])


def _hook_stop_layer(model, hook_name: str) -> Optional[int]:
    """The `stop_at_layer` after which `hook_name` has fired (None: it needs the full forward)."""
    if hook_name == "hook_embed":
        return 0
    parts = hook_name.split(".")
    if parts[0] == "blocks" and len(parts) > 2 and parts[1].isdigit():
        return int(parts[1]) + 1
    return None


@torch.no_grad()
def stream_activations(
    model,
    prompts: Optional[Sequence[str]] = None,
    responses: Optional[Sequence[str]] = None,
    hook_name: str = "",
    *,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    positions: str = "all",
    batch_size: int = 8,
    progress: Union[bool, str] = False,
    device: Optional[Union[str, torch.device]] = "cpu",
) -> Iterator[torch.Tensor]:
    """Yield the activation at `hook_name` batch by batch: [n_tokens, ...] over every non-pad token
    (`positions="all"`) or [batch, ...] at each readout position (`positions="readout"`).

    Give either (prompts, responses) or already tokenised `input_ids` (+ `attention_mask`). The forward
    stops right after the hook's block, so streaming an early layer costs only that much of the model.
    """
    if positions not in ("all", "readout"):
        raise ValueError(f"positions must be 'all' or 'readout', got {positions!r}")
    if hook_name not in model.hook_dict:
        raise ValueError(f"unknown hook {hook_name!r}; e.g. 'blocks.0.hook_resid_post' (see model.hook_dict)")
    if hook_name.endswith(("hook_attn_scores", "hook_pattern")):
        raise ValueError(f"{hook_name} has no per-token layout [batch, pos, ...]; stream a residual-like hook")
    if input_ids is None:
        if prompts is None or responses is None:
            raise ValueError("give (prompts, responses) or input_ids to stream activations from")
        n = len(prompts)
    else:
        n = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
    stop = _hook_stop_layer(model, hook_name)
    for sl in batches(n, batch_size, progress):
        if input_ids is None:
            tok = tokenize(model, prompts[sl], responses[sl])
        else:
            ids, mask = input_ids[sl].to(model.cfg.device), attention_mask[sl].to(model.cfg.device)
            tok = Tokenized(ids, mask, model.readout_positions(ids, mask))
        grabbed: Dict[str, torch.Tensor] = {}

        def grab(tensor: torch.Tensor, hook) -> None:
            grabbed["acts"] = tensor.detach()

        model.run_with_hooks(
            tok.input_ids, tok.attention_mask, fwd_hooks=[(hook_name, grab)],
            **({"stop_at_layer": stop} if stop is not None else {"readout_positions": tok.readout}),
        )
        acts = grabbed["acts"]
        if positions == "all":
            out = acts[tok.attention_mask.bool().to(acts.device)]
        else:
            out = acts[torch.arange(acts.shape[0], device=acts.device), tok.readout.to(acts.device)]
        yield out.to(device) if device is not None else out
