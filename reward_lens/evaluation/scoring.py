"""Rewards of (prompt, response) texts, tokenised by the model itself and scored in batches (of similar
lengths: the texts are scored longest first, and the rewards returned in the callers' order).

Identical (prompt, response) texts are scored once, so duplicates get exactly the same reward and a tie
between identical responses is a tie (padding in a different batch cannot split it)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import batches, tokenize


def _key(text: Any) -> str:
    return text if isinstance(text, str) else repr(text)


@torch.no_grad()
def score_texts(
    model,
    prompts: Sequence[Any],
    responses: Sequence[Any],
    *,
    batch_size: int = 16,
    progress: Union[bool, str] = False,
) -> np.ndarray:
    """[n] float64 rewards of each (prompt, response): `model.to_tokens`, then
    `model(ids, attention_mask=...)`."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    index: Dict[tuple, int] = {}
    unique: List[tuple] = []
    which = []
    for p, r in zip(prompts, responses):
        k = (_key(p), _key(r))
        if k not in index:
            index[k] = len(unique)
            unique.append((p, r))
        which.append(index[k])
    # Longest first, by characters: batches of similar lengths pad little (and an out-of-memory comes early).
    order = sorted(range(len(unique)), key=lambda i: -(len(_key(unique[i][0])) + len(_key(unique[i][1]))))
    rewards = np.empty(len(unique), dtype=np.float64)
    label = progress if isinstance(progress, str) else ("scoring responses" if progress else False)
    for sl in batches(len(order), batch_size, label):
        ids = order[sl]
        tok = tokenize(model, [unique[i][0] for i in ids], [unique[i][1] for i in ids])
        out = model(tok.input_ids, attention_mask=tok.attention_mask)
        if out.ndim > 1:  # a multi-output head: its first output is the reward
            out = out.reshape(out.shape[0], -1)[:, 0]
        rewards[ids] = out.detach().cpu().double().numpy()  # the model's precision: float64 ties stay exact
    return rewards[np.asarray(which, dtype=np.int64)] if which else np.empty(0)


def check_finite(frame: pd.DataFrame, source: str) -> None:
    """Refuse non-finite rewards (a float16 overflow, a broken head): no score is computed from them."""
    bad = ~np.isfinite(frame["reward"].to_numpy(dtype=np.float64))
    if bad.any():
        r = frame[bad].iloc[0]
        raise ValueError(
            f"{source}: non-finite reward ({r.reward}) for row {int(r.row) + 1} (id {r.id!r}), {r.role} "
            f"response {int(r.k) + 1}, and {int(bad.sum()) - 1} more; no score computed: load the model "
            "in float32 (--dtype float32) or check its weights"
        )
