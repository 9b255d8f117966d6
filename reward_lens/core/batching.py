"""Batching and padding: (prompt, response) lists and preference pairs tokenised in batches, token
sequences padded as the model reads them, each row's readout position alongside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from reward_lens.data.pairs import TokenPair
from reward_lens.model.readout import readout_needs_pad_id
from reward_lens.model.truncation import one_truncation_warning


@dataclass
class Tokenized:
    input_ids: torch.Tensor  # [batch, pos]
    attention_mask: torch.Tensor  # [batch, pos]
    readout: torch.Tensor  # [batch] readout position of each row
    labels: Optional[List[str]] = None  # what each row is ("pair rl-3, chosen"), for error messages


def tokenize(
    model, prompts: Sequence[str], responses: Sequence[str], padding_side: Optional[str] = None
) -> Tokenized:
    batch = model.to_tokens(list(prompts), list(responses), padding_side=padding_side)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


def take_rows(model, tok: Tokenized, rows: torch.Tensor) -> Tokenized:
    """Rows of a tokenised batch, re-padded to their own longest (the padding columns no row attends to
    dropped): what tokenising those texts alone gives, readout positions recomputed."""
    ids, mask = tok.input_ids[rows], tok.attention_mask[rows]
    cols = mask.bool().any(0).nonzero()
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    ids, mask = ids[:, lo:hi], mask[:, lo:hi]
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


def length_order(tok: Tokenized) -> torch.Tensor:
    """Row indices by token count (stable): batches of similar lengths waste no compute on padding."""
    return torch.argsort(tok.attention_mask.sum(1).cpu(), stable=True)


def batches(
    n: int, batch_size: int, progress: Union[bool, str] = False, within: Optional[slice] = None
) -> Iterator[slice]:
    """Slices covering range(n) in chunks; a tqdm bar when `progress` (a str is its label). `within`: only
    the chunks of that part of range(n) (a data-parallel rank's shard), starting at its start."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    lo, hi = (0, n) if within is None else (within.start or 0, min(n, within.stop))
    starts = range(lo, hi, batch_size)
    if progress and hi - lo > batch_size:
        starts = tqdm(starts, desc=progress if isinstance(progress, str) else None, leave=False)
    with one_truncation_warning():  # inputs cut in any batch: one warning when the loop ends
        for s in starts:
            yield slice(s, min(hi, s + batch_size))


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


def pad_token_rows(model, rows: List[torch.Tensor], side: str) -> Tokenized:
    pad = model.cfg.pad_token_id
    by_mask = not readout_needs_pad_id(model.cfg)  # the mask alone locates the readout (OpenRLHF's rule)
    # pad = EOS (TRL's default): a trailing EOS is real text, read one token before it as transformers does
    by_mask = by_mask or (pad is not None and getattr(model.tokenizer, "eos_token_id", None) == pad)
    if pad is None and len(rows) > 1 and not by_mask:
        raise ValueError(
            "cannot batch token pairs: the model config has no pad_token_id; set model.cfg.pad_token_id "
            "or use batch_size=1"
        )
    for r in rows:
        if pad is not None and int(r[-1]) == pad and not by_mask:
            raise ValueError(
                f"a token sequence ends with the pad token id {pad}, so its readout cannot be found; drop "
                "trailing pads"
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


def unpadded(tok: Tokenized, b: int) -> torch.Tensor:
    return tok.input_ids[b][tok.attention_mask[b].bool()]


def tokenize_pair_batch(
    model, pairs: Sequence, index: slice, padding_side: Optional[str] = None
) -> PairBatch:
    """Tokenise `pairs` (all PreferencePair or all TokenPair) into a PairBatch."""
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if isinstance(pairs[0], TokenPair):
        side = padding_side or "right"
        chosen = pad_token_rows(model, [p.chosen for p in pairs], side)
        rejected = pad_token_rows(model, [p.rejected for p in pairs], side)
    else:
        chosen = tokenize(model, [p.prompt for p in pairs], [p.chosen for p in pairs], padding_side)
        rejected = tokenize(model, [p.prompt for p in pairs], [p.rejected for p in pairs], padding_side)
    prompt_len = []
    # On the host, once per batch: a per-pair comparison of device ids would sync the device per pair.
    host_c, host_r = (
        Tokenized(chosen.input_ids.cpu(), chosen.attention_mask.cpu(), chosen.readout),
        Tokenized(rejected.input_ids.cpu(), rejected.attention_mask.cpu(), rejected.readout),
    )
    for b, p in enumerate(pairs):
        c, r = unpadded(host_c, b), unpadded(host_r, b)
        n = min(len(c), len(r))
        given = getattr(p, "prompt_len", None)
        if given is not None:
            if not 0 <= given <= n:
                raise ValueError(
                    f"pair {p.id or b}: prompt_len={given} is outside [0, {n}] (the shorter sequence's "
                    "length)"
                )
            prompt_len.append(int(given))
        else:
            differ = (c[:n] != r[:n]).nonzero()
            prompt_len.append(int(differ[0]) if len(differ) else n)
    names = [f"pair {getattr(p, 'id', None) or index.start + b}" for b, p in enumerate(pairs)]
    chosen.labels, rejected.labels = [f"{n}, chosen" for n in names], [f"{n}, rejected" for n in names]
    return PairBatch(chosen, rejected, torch.tensor(prompt_len, dtype=torch.long), index)


def pair_batches(
    model,
    pairs: Sequence,
    batch_size: int,
    progress: Union[bool, str] = False,
    padding_side: Optional[str] = None,
    within: Optional[slice] = None,
) -> Iterator[PairBatch]:
    """PairBatches of `pairs` (of `pairs[within]` only, with indices into `pairs`, when given)."""
    for sl in batches(len(pairs), batch_size, progress, within):
        yield tokenize_pair_batch(model, pairs[sl], sl, padding_side)


def cat_padded(chunks: List[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0, zero-padding a trailing key axis that differs between batches."""
    if all(c.shape[1:] == chunks[0].shape[1:] for c in chunks):
        return torch.cat(chunks)
    width = max(c.shape[-1] for c in chunks)
    return torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1])) for c in chunks])
