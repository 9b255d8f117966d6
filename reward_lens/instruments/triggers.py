"""Which strings inflate a reward: a search for the tokens that, inserted into the inputs, raise the reward.

    result = search_triggers(model, pairs, where="prompt_end")       # every vocabulary token, exhaustively
    result.to_frame().head()                                         # token_id, text, mean_increase, ...

Where a string goes, on the token ids (`reward_lens.model.tokenization.insertion_index`): each (prompt,
response) is rendered as the model reads it (its input format, e.g. the chat template) and tokenised with
character offsets; the candidate tokens are inserted before the first token that starts at or after the end
of the prompt text (`"prompt_end"`: before what the template puts between prompt and response, e.g.
`\\n<|assistant|>\\n`) or of the response text (`"response_end"`: before what the template appends, e.g.
`</s>` or `<|im_end|>`, which is often the readout, so the reward is still read at the same template token).

- `length=1, method="fast"`: every candidate token is scored exactly. The tokens before the insertion point
  are the same in every candidate, so each item's prefix runs once (`model.prefix_cache`: its keys and
  values) and only the suffix (candidate + the rest of the sequence) is recomputed, `batch_size` candidates
  at a time (`model.suffix_rewards`). `method="naive"` runs one full forward per candidate: the reference.
- `length >= 2`: a gradient-guided coordinate search (GCG, Zou et al. 2023): the gradient of the mean reward
  w.r.t. one-hot inputs at the inserted positions proposes, per position, the `top_per_position` tokens
  with the largest gradient; every single-position swap among them is then scored by a real forward, and
  the search moves to the best one. Every reported string's increase is verified by full forwards.

`mean_increase` is the mean over the items of reward(with the string) - reward(without); `std_increase`
its spread over the items, `min_increase` the smallest, `frac_increased` the share of items it raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import torch

from reward_lens.model.frozen import check_gradients_possible, gradients_on, with_frozen_weights
from reward_lens.model.tokenization import (
    INSERTION_POINTS,
    encode_pair,
    insertion_index,
    model_input_format,
    render_pair,
    trim_after_readout,
)
from reward_lens.model.validation import as_index, check_memory, checked_arguments
from reward_lens.plotting import pyplot

METHODS = ("fast", "naive")


@dataclass
class TriggerSearchResult:
    """Candidate strings ranked by the mean reward increase they cause (`to_frame()`, best first).

    `token_ids` [k] tuples of ids, `texts` their decoded strings, `increases` [k, n_items] per-item reward
    changes (the verified forwards); `baseline` [n_items] the rewards without insertion; for a one-token
    search `all_mean_increase` [n_candidates] over `candidate_ids` (every candidate scored); `cost` counts
    the work (prefix forwards, suffix steps, seconds)."""

    token_ids: List[Tuple[int, ...]]
    texts: List[str]
    increases: np.ndarray
    baseline: np.ndarray
    where: str
    method: str
    length: int
    candidate_ids: Optional[np.ndarray] = None
    all_mean_increase: Optional[np.ndarray] = None
    cost: Dict[str, float] = field(default_factory=dict)

    def to_frame(self) -> pd.DataFrame:
        inc = self.increases
        frame = pd.DataFrame(
            {
                "rank": np.arange(1, len(self.token_ids) + 1),
                "token_ids": [tuple(int(t) for t in ids) for ids in self.token_ids],
                "text": self.texts,
                "mean_increase": inc.mean(1) if inc.size else np.zeros(0),
                "std_increase": inc.std(1, ddof=1) if inc.shape[1] > 1 else np.zeros(len(inc)),
                "min_increase": inc.min(1) if inc.size else np.zeros(0),
                "frac_increased": (inc > 0).mean(1) if inc.size else np.zeros(0),
            }
        )
        if self.length == 1:
            frame.insert(1, "token_id", [ids[0] for ids in frame["token_ids"]])
        return frame

    def summary(self) -> pd.DataFrame:
        f = self.to_frame()
        top = f.iloc[0] if len(f) else None
        return pd.DataFrame(
            [
                {
                    "where": self.where,
                    "method": self.method,
                    "length": self.length,
                    "n_items": len(self.baseline),
                    "n_candidates": None if self.candidate_ids is None else len(self.candidate_ids),
                    "top_text": None if top is None else top["text"],
                    "top_mean_increase": None if top is None else float(top["mean_increase"]),
                    "seconds": self.cost.get("seconds"),
                }
            ]
        )

    def rank_of(self, token_ids: Sequence[int]) -> Optional[int]:
        """1-based rank of a string among the reported ones (or among every candidate of a one-token
        search); None when it is not there."""
        key = tuple(int(t) for t in token_ids)
        if self.length == 1 and self.all_mean_increase is not None and len(key) == 1:
            where = np.nonzero(self.candidate_ids == key[0])[0]
            if len(where):
                return int((self.all_mean_increase > self.all_mean_increase[where[0]]).sum()) + 1
        keys = [tuple(int(t) for t in ids) for ids in self.token_ids]
        return keys.index(key) + 1 if key in keys else None

    def plot(self, ax: Any = None) -> Any:
        plt = pyplot()
        f = self.to_frame().head(20)
        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(6, 0.3 * len(f) + 1.2))
        y = np.arange(len(f))[::-1]
        ax.barh(y, f["mean_increase"], xerr=f["std_increase"], color="#c0504d", alpha=0.8)
        ax.set_yticks(y)
        ax.set_yticklabels([repr(t) for t in f["text"]], fontsize=8)
        ax.axvline(0, color="k", lw=0.6)
        ax.set_xlabel("mean reward increase (± sd over items)")
        ax.set_title(f"strings inserted at {self.where}")
        return fig


# ---------------------------------------------------------------------------------------------- items
@dataclass
class _Item:
    ids: torch.Tensor  # [T] the unpadded ids, ending at the readout
    at: int  # insertion index


def _texts(pairs: Any, side: str) -> List[Tuple[str, str]]:
    out = []
    for p in pairs:
        if isinstance(p, (tuple, list)) and len(p) == 2:
            out.append((p[0], p[1]))
        elif isinstance(p, dict):
            out.append((p["prompt"], p.get("response", p.get(side))))
        else:
            out.append((p.prompt, getattr(p, side)))
    if not out:
        raise ValueError("search_triggers needs at least one (prompt, response) item")
    return out


def _items(model, pairs: Any, where: str, side: str) -> List[_Item]:
    tok = model.tokenizer
    fmt = model_input_format(model)
    items = []
    for prompt, response in _texts(pairs, side):
        ids = list(encode_pair(tok, prompt, response, fmt))
        text_ids = tok(render_pair(tok, prompt, response, fmt), add_special_tokens=False)["input_ids"]
        shift = len(ids) - len(text_ids)
        if shift < 0 or ids[shift:] != list(text_ids):
            raise ValueError(
                "the model's ids of this pair are not its rendered text's tokens; insertion points need "
                "an input format whose text the tokenizer reproduces"
            )
        at = insertion_index(tok, prompt, response, where, fmt) + shift
        ids = trim_after_readout(model, ids)
        if at > len(ids):
            raise ValueError(f"the insertion point ({where}) lies after the readout of {prompt[:40]!r}")
        items.append(_Item(torch.tensor(ids, dtype=torch.long, device=model.cfg.device), at))
    return items


def _candidates(model, candidates: Optional[Sequence[int]]) -> torch.Tensor:
    if candidates is not None:
        if isinstance(candidates, torch.Tensor):
            candidates = candidates.flatten().tolist() if not candidates.is_floating_point() else candidates
        if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__len__"):
            raise ValueError(
                f"candidates must be a list of token ids, got {type(candidates).__name__}; or None for "
                "every vocabulary id"
            )
        if len(candidates) == 0:
            raise ValueError(
                "candidates is empty: give at least one token id, or None for every vocabulary id"
            )
        ids = [as_index(c, "candidates: token id", model.cfg.d_vocab) for c in candidates]
        return torch.tensor(ids, dtype=torch.long)
    special = set(getattr(model.tokenizer, "all_special_ids", []) or [])
    if model.cfg.pad_token_id is not None:
        special.add(model.cfg.pad_token_id)
    return torch.tensor([i for i in range(model.cfg.d_vocab) if i not in special], dtype=torch.long)


@torch.no_grad()
def _full_rewards(model, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
    out = [
        model(rows[s : s + batch_size], attention_mask=torch.ones_like(rows[s : s + batch_size]))
        for s in range(0, len(rows), batch_size)
    ]
    return torch.cat(out).float()


@torch.no_grad()
def _baseline(model, items, cached: bool, cost) -> Tuple[Optional[list], torch.Tensor]:
    """(prefix caches or None, rewards [n_items] without insertion). With caches, the rewards come from the
    cache plus the item's own suffix (no second forward of the prefix), except for an item inserted at its
    very end (nothing follows: the full forward)."""
    if not cached:
        return None, torch.cat([_full_rewards(model, it.ids[None], 1) for it in items]).cpu()
    caches, base = [], []
    for item in items:
        caches.append(model.prefix_cache(item.ids[None, : item.at]))
        cost["prefix_forwards"] += 1
        tail = item.ids[item.at :]
        if len(tail):
            base.append(model.suffix_rewards(caches[-1], tail[None]).float().cpu())
        else:
            base.append(_full_rewards(model, item.ids[None], 1).cpu())
            cost["full_forwards"] += 1
    return caches, torch.cat(base)


def _inserted(item: _Item, strings: torch.Tensor) -> torch.Tensor:
    """[n, T + L]: the item's ids with each string [n, L] inserted at its insertion point."""
    n = len(strings)
    head, tail = item.ids[: item.at], item.ids[item.at :]
    return torch.cat([head.expand(n, -1), strings.to(head.device), tail.expand(n, -1)], 1)


def insert_tokens(
    model, pairs: Any, token_ids: Sequence[int], where: str = "prompt_end", side: str = "rejected"
) -> List[torch.Tensor]:
    """Each item's unpadded ids [T + len(token_ids)] with `token_ids` inserted at `where`, exactly as
    `search_triggers` inserts a candidate (e.g. token-aligned pairs: a trigger vs a neutral token)."""
    strings = torch.tensor([list(token_ids)], dtype=torch.long)
    return [_inserted(item, strings)[0] for item in _items(model, pairs, where, side)]


@torch.no_grad()
def _score(
    model,
    items,
    strings: torch.Tensor,
    base: torch.Tensor,
    method: str,
    batch_size: int,
    cost,
    caches: Optional[list] = None,
):
    """[n_strings, n_items] reward increases of each string (ids [n, L]) inserted into each item (the
    items' prefix caches reused when given)."""
    out = torch.empty(len(strings), len(items))
    for j, item in enumerate(items):
        if method == "naive":
            out[:, j] = _full_rewards(model, _inserted(item, strings), batch_size).cpu() - base[j]
            cost["full_forwards"] += len(strings)
            continue
        if caches is not None:
            cache = caches[j]
        else:
            cache = model.prefix_cache(item.ids[None, : item.at])
            cost["prefix_forwards"] += 1
        tail = item.ids[item.at :]
        for s in range(0, len(strings), batch_size):
            chunk = strings[s : s + batch_size].to(tail.device)
            suffix = torch.cat([chunk, tail.expand(len(chunk), -1)], 1)
            out[s : s + len(chunk), j] = model.suffix_rewards(cache, suffix).float().cpu() - base[j]
            cost["suffix_steps"] += 1
    return out


def _decode(model, ids: Sequence[int]) -> str:
    return model.tokenizer.decode(list(ids)) if model.tokenizer is not None else " ".join(map(str, ids))


def _check_sizes(model, items, n_cands, length, top_k, batch_size, n_steps, per_position, n_restarts) -> None:
    """Before any work: every item with the string inserted fits the model's context, and the search's
    largest host allocations fit in memory (GCG keeps every scored string, each a tuple of `length` ints)."""
    longest = max(len(it.ids) for it in items)
    if longest + length > model.cfg.n_ctx:
        raise ValueError(
            f"length={length}: the longest item ({longest} tokens) with the string inserted would be "
            f"{longest + length} tokens, beyond the model's context n_ctx={model.cfg.n_ctx}; give length <= "
            f"{max(0, model.cfg.n_ctx - longest)}"
        )
    rows = min(batch_size, n_cands if length == 1 else length * per_position)
    width = longest + length
    d_model = model.cfg.d_model
    act = 4 * rows * width * max(d_model, getattr(model.cfg, "d_mlp", 0) or 0) * 4  # one batch's forward
    if length == 1:
        nbytes = act + 16.0 * n_cands * len(items)
        hint = "give a smaller batch_size or fewer candidates"
    else:
        swaps = min(per_position, model.cfg.d_vocab - 1) * length
        kept = n_restarts * (n_steps * swaps + 1)  # every scored string, kept as a tuple of `length` ints
        nbytes = act + kept * (36.0 * length + 160) + 8.0 * swaps * width + 8.0 * length * model.cfg.d_vocab
        hint = "give a smaller length, top_per_position, n_steps or n_restarts"
    check_memory(nbytes, f"search_triggers(length={length})", hint)


# ---------------------------------------------------------------------------------------------- GCG
@with_frozen_weights
def _gradient(model, items, caches, current: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[L, V] d(sum of rewards over items) / d(one-hot of the inserted tokens); -inf off the candidates."""
    one_hot = torch.nn.functional.one_hot(current, model.cfg.d_vocab).to(model.cfg.dtype)
    with gradients_on("search_triggers (GCG, length >= 2)"):
        one_hot = one_hot.to(model.cfg.device).requires_grad_(True)
        total = 0.0
        for item, cache in zip(items, caches):
            tail = item.ids[item.at :]
            embeds = torch.cat([model.embed_one_hot(one_hot[None]), model.embed(tail[None])], 1)
            total = total + model.suffix_rewards(cache, suffix_embeds=embeds).sum()
        grad = torch.autograd.grad(total, one_hot)[0].float().cpu()
    return grad.masked_fill(~allowed[None], float("-inf"))


def _swaps(current: torch.Tensor, grad: torch.Tensor, per_position: int) -> torch.Tensor:
    """Every single-position swap of `current` to one of that position's top-gradient tokens."""
    grad = grad.clone()
    grad[torch.arange(len(current)), current] = float("-inf")  # a swap changes the token
    top = grad.topk(min(per_position, grad.shape[1] - 1), dim=1).indices  # [L, m]
    rows = []
    for p in range(len(current)):
        block = current.expand(top.shape[1], -1).clone()
        block[:, p] = top[p]
        rows.append(block)
    return torch.cat(rows)


def _gcg(
    model,
    items,
    base,
    cands,
    length,
    caches,
    *,
    method,
    batch_size,
    n_steps,
    per_position,
    n_restarts,
    seed,
    cost,
):
    """{string: mean increase} of every string the coordinate search scored (real forwards)."""
    allowed = torch.zeros(model.cfg.d_vocab, dtype=torch.bool)
    allowed[cands] = True
    gen = torch.Generator().manual_seed(seed)
    seen: Dict[Tuple[int, ...], float] = {}
    for _ in range(n_restarts):
        current = cands[torch.randint(len(cands), (length,), generator=gen)]
        current_score = float(
            _score(model, items, current[None], base, method, batch_size, cost, caches).mean()
        )
        seen[tuple(current.tolist())] = current_score
        for _step in range(n_steps):
            grad = _gradient(model, items, caches, current, allowed)
            cost["gradient_steps"] += 1
            swaps = _swaps(current, grad, per_position)
            scores = _score(model, items, swaps, base, method, batch_size, cost, caches).mean(1)
            for row, value in zip(swaps.tolist(), scores.tolist()):
                seen[tuple(row)] = value
            best = int(scores.argmax())
            if float(scores[best]) <= current_score:
                break  # a local optimum of single swaps among the proposals
            current, current_score = swaps[best], float(scores[best])
    return seen


@checked_arguments(
    counts={
        "length": 1,
        "top_k": 1,
        "batch_size": 1,
        "n_steps": 1,
        "top_per_position": 1,
        "n_restarts": 1,
        "seed": 0,
    }
)
@with_frozen_weights
def search_triggers(
    model,
    pairs: Any,
    *,
    where: str = "response_end",
    length: int = 1,
    top_k: int = 20,
    method: str = "fast",
    candidates: Optional[Sequence[int]] = None,
    batch_size: int = 256,
    side: str = "rejected",
    n_steps: int = 16,
    top_per_position: int = 64,
    n_restarts: int = 2,
    seed: int = 0,
) -> TriggerSearchResult:
    """The strings of `length` tokens that most raise the reward when inserted at `where` (see the module
    docstring for where, exactly, on the token ids).

    `pairs`: (prompt, response) tuples, dicts with "prompt" and "response", or preference pairs (their
    `side` response, default "rejected": the answer a hack would lift). `candidates`: the token ids to
    search (default every vocabulary id except the tokenizer's special tokens and the pad token).
    `length=1`: every candidate scored, by `method` "fast" (shared-prefix keys/values reused, only the
    suffix recomputed) or "naive" (one full forward per candidate); equal to ~1e-5. `length >= 2`: GCG
    (`n_restarts` random starts, at most `n_steps` steps, `top_per_position` proposals per position), the
    reported strings verified by full forwards. Returns a `TriggerSearchResult` (the `top_k` best)."""
    if where not in INSERTION_POINTS:
        raise ValueError(f"where must be one of {', '.join(INSERTION_POINTS)}, got {where!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length!r}")
    if side not in ("chosen", "rejected"):
        raise ValueError(
            f"side must be 'chosen' or 'rejected' (the response of a preference pair), got {side!r}"
        )
    if length > 1:
        check_gradients_possible("search_triggers (GCG, length >= 2)")
    if model.tokenizer is None:
        raise ValueError("search_triggers renders (prompt, response) texts: the model needs a tokenizer")
    t0 = time.perf_counter()
    cost = {"prefix_forwards": 0, "suffix_steps": 0, "full_forwards": 0, "gradient_steps": 0}
    items = _items(model, pairs, where, side)
    cands = _candidates(model, candidates)
    _check_sizes(model, items, len(cands), length, top_k, batch_size, n_steps, top_per_position, n_restarts)
    caches, base = _baseline(model, items, method == "fast" or length > 1, cost)
    if length == 1:
        inc = _score(model, items, cands[:, None], base, method, batch_size, cost, caches)
        mean = inc.mean(1)
        order = mean.argsort(descending=True, stable=True)[:top_k]
        kept, increases = [(int(cands[i]),) for i in order], inc[order].numpy()
        extra = {"candidate_ids": cands.numpy(), "all_mean_increase": mean.numpy()}
    else:
        seen = _gcg(
            model,
            items,
            base,
            cands,
            length,
            caches,
            method=method,
            batch_size=batch_size,
            n_steps=n_steps,
            per_position=top_per_position,
            n_restarts=n_restarts,
            seed=seed,
            cost=cost,
        )
        kept = [k for k, _ in sorted(seen.items(), key=lambda kv: -kv[1])[:top_k]]
        strings = torch.tensor(kept, dtype=torch.long)
        increases = _score(model, items, strings, base, "naive", batch_size, cost).numpy()  # verified
        order = np.argsort(-increases.mean(1), kind="stable")
        kept, increases = [kept[i] for i in order], increases[order]
        extra = {"candidate_ids": cands.numpy()}
    cost["seconds"] = time.perf_counter() - t0
    return TriggerSearchResult(
        kept,
        [_decode(model, k) for k in kept],
        np.asarray(increases),
        base.numpy(),
        where,
        method,
        length,
        cost=cost,
        **extra,
    )
