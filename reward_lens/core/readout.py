"""The one batching and readout-gathering helper every instrument shares.

Instruments never write hook plumbing of their own: they ask for rewards and readout-position
activations of (prompt, response) lists here, in batches, with a progress bar on long runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from reward_lens.core.validation import check_finite_rewards
from reward_lens.model.native import QUERY_AXIS_2_HOOKS
from reward_lens.model.truncation import one_truncation_warning

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


@dataclass
class Tokenized:
    input_ids: torch.Tensor  # [batch, pos]
    attention_mask: torch.Tensor  # [batch, pos]
    readout: torch.Tensor  # [batch] readout position of each row
    labels: Optional[List[str]] = None  # what each row is ("pair rl-3, chosen"), for error messages


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
    with one_truncation_warning():  # inputs cut in any batch: one warning when the loop ends
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
        check_finite_rewards(out, [f"input {i} (prompt {str(prompts[i])[:40]!r})" for i in range(sl.start, sl.stop)])
        rewards.append(out.detach())
        for name, value in cache.items():
            is_query_axis_2 = name.endswith(QUERY_AXIS_2_HOOKS)
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
    if hook_name.endswith(QUERY_AXIS_2_HOOKS):
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


# ---------------------------------------------------------------------------------------------------
# Preference pairs: chosen and rejected batches side by side, and the linear readout of the reward.


@dataclass
class PairBatch:
    """One batch of pairs, tokenised: chosen and rejected padded separately (their lengths differ).

    `prompt_len[b]`: shared prompt tokens of pair b (its `prompt_len`, else the longest common prefix of
    the two token sequences). `index`: which pairs of the call these are.
    """

    chosen: Tokenized
    rejected: Tokenized
    prompt_len: torch.Tensor  # [batch]
    index: slice


def first_token(tok: Tokenized) -> torch.Tensor:
    """Index of each row's first attended token (0 when right-padded)."""
    return tok.attention_mask.long().argmax(-1)


def _pad_token_rows(model, rows: List[torch.Tensor], side: str) -> Tokenized:
    pad = model.cfg.pad_token_id
    by_mask = getattr(model.cfg, "readout", None) == "last_attended"  # the mask alone locates the readout
    if pad is None and len(rows) > 1 and not by_mask:
        raise ValueError(
            "cannot batch token pairs: the model config has no pad_token_id; set model.cfg.pad_token_id or use batch_size=1"
        )
    for r in rows:
        if pad is not None and int(r[-1]) == pad and not by_mask:
            raise ValueError(
                f"a token sequence ends with the pad token id {pad}, so its readout cannot be found; drop trailing pads"
            )
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad if pad is not None else 0, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    device = model.cfg.device
    ids, mask = ids.to(device), mask.to(device)
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


def _unpadded(tok: Tokenized, b: int) -> torch.Tensor:
    return tok.input_ids[b][tok.attention_mask[b].bool()]


def tokenize_pair_batch(model, pairs: Sequence, index: slice, padding_side: Optional[str] = None) -> PairBatch:
    """Tokenise `pairs` (all PreferencePair or all TokenPair) into a PairBatch."""
    from reward_lens.data.pairs import TokenPair

    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if isinstance(pairs[0], TokenPair):
        side = padding_side or "right"
        chosen = _pad_token_rows(model, [p.chosen for p in pairs], side)
        rejected = _pad_token_rows(model, [p.rejected for p in pairs], side)
    else:
        chosen = tokenize(model, [p.prompt for p in pairs], [p.chosen for p in pairs], padding_side)
        rejected = tokenize(model, [p.prompt for p in pairs], [p.rejected for p in pairs], padding_side)
    prompt_len = []
    for b, p in enumerate(pairs):
        c, r = _unpadded(chosen, b), _unpadded(rejected, b)
        n = min(len(c), len(r))
        given = getattr(p, "prompt_len", None)
        if given is not None:
            if not 0 <= given <= n:
                raise ValueError(f"pair {p.id or b}: prompt_len={given} is outside [0, {n}] (the shorter sequence's length)")
            prompt_len.append(int(given))
        else:
            differ = (c[:n] != r[:n]).nonzero()
            prompt_len.append(int(differ[0]) if len(differ) else n)
    names = [f"pair {getattr(p, 'id', None) or index.start + b}" for b, p in enumerate(pairs)]
    chosen.labels, rejected.labels = [f"{n}, chosen" for n in names], [f"{n}, rejected" for n in names]
    return PairBatch(chosen, rejected, torch.tensor(prompt_len, dtype=torch.long), index)


def pair_batches(
    model, pairs: Sequence, batch_size: int, progress: Union[bool, str] = False, padding_side: Optional[str] = None
) -> Iterator[PairBatch]:
    for sl in batches(len(pairs), batch_size, progress):
        yield tokenize_pair_batch(model, pairs[sl], sl, padding_side)


def check_scalar_reward(model) -> None:
    if model.cfg.head_type != "armorm" and model.cfg.n_outputs != 1:
        raise ValueError(
            f"this reward head has {model.cfg.n_outputs} outputs; the instruments decompose one scalar reward. "
            "Slice the head to the output you study (reward_head.W_R[:, [j]], b_R[[j]], cfg.n_outputs = 1)"
        )


@torch.no_grad()
def readout_direction(model, tok: Tokenized) -> "tuple[torch.Tensor, torch.Tensor]":
    """Per-sequence (direction [batch, d_model], bias [batch]), float32, such that
    reward = direction . (resid_final[readout] / ln_final.hook_scale) + bias, exactly.

    A multi-objective ArmoRM head has a prompt-conditioned direction (`model.reward_direction_for`, one
    extra forward pass); every other head has the single `model.reward_direction`.
    """
    check_scalar_reward(model)
    B = tok.input_ids.shape[0]
    if model.cfg.head_type == "armorm" and hasattr(model, "reward_direction_for"):
        direction = model.reward_direction_for(tok.input_ids, tok.attention_mask)
    else:
        direction = model.reward_direction.expand(B, -1)
    bias = torch.as_tensor(model.reward_bias).float().reshape(()).expand(B)
    return direction.detach().float(), bias.detach().to(direction.device)


def reward_from_final_resid(
    model, resid: torch.Tensor, direction: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """The reward read from final residual vectors [..., d_model] with the final norm recomputed on them,
    as the model does at its readout: direction . resid / scale(resid) + bias."""
    xf = resid.float()
    if str(model.cfg.normalization_type).startswith("LN"):  # a LayerNorm final norm (generic path) centres first
        xf = xf - xf.mean(-1, keepdim=True)
    scale = (xf.pow(2).mean(-1, keepdim=True) + model.ln_final.eps).sqrt()
    return ((xf / scale) * direction).sum(-1) + bias


@dataclass
class Capture:
    """One forward of a tokenised batch: its rewards, named activations at each readout position
    (`at_readout[name]`: [batch, ...]) and named full activations (`full[name]`: [batch, pos, ...])."""

    tok: Tokenized
    rewards: torch.Tensor
    at_readout: Dict[str, torch.Tensor]
    full: Dict[str, torch.Tensor]


@torch.no_grad()
def capture(model, tok: Tokenized, readout_names: Sequence[str] = (), full_names: Sequence[str] = ()) -> Capture:
    """Run `tok` once, keeping `readout_names` at the readout and `full_names` whole (one forward)."""
    at_readout: Dict[str, torch.Tensor] = {}
    full: Dict[str, torch.Tensor] = {}
    rows = torch.arange(tok.input_ids.shape[0], device=tok.input_ids.device)
    readout = tok.readout.to(tok.input_ids.device)

    def keep_readout(tensor: torch.Tensor, hook) -> None:
        at_readout[hook.name] = tensor[rows, readout] if tensor.dim() >= 3 else tensor

    def keep_full(tensor: torch.Tensor, hook) -> None:
        full[hook.name] = tensor

    hooks = [(n, keep_readout) for n in dict.fromkeys(readout_names)]
    hooks += [(n, keep_full) for n in dict.fromkeys(full_names)]
    rewards = model.run_with_hooks(
        tok.input_ids, tok.attention_mask, readout_positions=tok.readout, fwd_hooks=hooks
    )
    check_finite_rewards(rewards, tok.labels)
    return Capture(tok, rewards, at_readout, full)
