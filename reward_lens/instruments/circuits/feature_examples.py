"""Each transcoder feature's top activating texts, what a feature dashboard shows beside a feature and what
the feature graph's view shows for each feature:

    ex = feature_examples(model, tc, texts, [(1, 23), (3, 7)], k=5)
    ex.to_frame()   # one row per (feature, rank): the text, its most active token and the tokens around it

A text's activation of a feature is its largest activation at any token (`tc[l].encode` of the MLP input
`blocks.{l}.ln2.hook_normalized`); a feature's top texts are the k texts of largest such activation, among
those where it fires at all. Texts: bare strings (read as `model(text)` reads them: BOS + text), (prompt,
response) tuples, or preference / contrast pairs (both responses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import pandas as pd
import torch

from reward_lens.core.batching import tokenize
from reward_lens.model.hooks import mlp_input_name as input_hook
from reward_lens.model.tokenization import tokenize_texts
from reward_lens.model.validation import checked_arguments

COLUMNS = ["component", "layer", "feature", "rank", "text", "label", "position", "activation"]
COLUMNS += ["before", "token", "after"]


@dataclass
class FeatureExamples:
    """The top activating texts of some transcoder features over `n_texts` texts: `frame` holds one row per
    (feature, rank): component (`L{l}F{i}`), layer, feature, rank (0 = the most active text), text (its
    index among the texts), label, position (the most active token's, in the text's own tokens),
    activation, and the tokens before, at and after that position."""

    frame: pd.DataFrame
    n_texts: int
    k: int

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> pd.DataFrame:
        """Each feature's most active text: component, activation, and its context with the token marked."""
        top = self.frame[self.frame["rank"] == 0]
        return pd.DataFrame(
            {
                "component": top.component.to_numpy(),
                "activation": top.activation.to_numpy(),
                "context": [f"{b}[[{t}]]{a}" for b, t, a in zip(top.before, top.token, top.after)],
                "label": top.label.to_numpy(),
            }
        )

    def of(self, component: str) -> pd.DataFrame:
        """The rows of one feature (`L{l}F{i}`), most active first."""
        return self.frame[self.frame.component == component].reset_index(drop=True)

    def plot(self, ax: Any = None) -> Any:
        """Each feature's top activations, one row of points per feature."""
        from reward_lens.plotting import figure_axes, finish

        created = ax is None
        fig, ax = figure_axes(ax, figsize=(6, 0.3 * max(4, self.frame.component.nunique())))
        names = list(dict.fromkeys(self.frame.component))
        y = [names.index(c) for c in self.frame.component]
        ax.scatter(self.frame.activation, y, s=12)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        ax.set_xlabel("activation (largest in the text)")
        ax.set_title(f"top {self.k} of {self.n_texts} texts per feature", fontsize=9)
        return finish(fig, created)


def text_units(texts: Any) -> Tuple[List[Tuple[str, Any]], List[str]]:
    """([(prompt, response or None)], labels) of every text in `texts`."""
    if isinstance(texts, (str, bytes)):
        texts = [texts]
    units: List[Tuple[str, Any]] = []
    labels: List[str] = []
    for n, item in enumerate(texts):
        if isinstance(item, str):
            units.append((item, None))
            labels.append(f"text {n}")
        elif isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(s, str) for s in item):
            units.append((item[0], item[1]))
            labels.append(f"text {n}")
        elif hasattr(item, "prompt") and (hasattr(item, "chosen") or hasattr(item, "positive")):
            sides = ("chosen", "rejected") if hasattr(item, "chosen") else ("positive", "negative")
            name = getattr(item, "id", None) or f"pair {n}"
            for side in sides:
                units.append((item.prompt, getattr(item, side)))
                labels.append(f"{name}, {side}")
        else:
            raise ValueError(
                f"cannot read a text from {type(item).__name__} (item {n}); pass strings, (prompt, response) "
                "tuples, or preference / contrast pairs"
            )
    if not units:
        raise ValueError("no texts given: pass strings, (prompt, response) tuples or pairs")
    return units, labels


def _batch(model, units: Sequence[Tuple[str, Any]]):
    """(input_ids, attention_mask) of units that are all bare texts or all (prompt, response)."""
    if units[0][1] is None:
        tok = tokenize_texts(model, [u[0] for u in units])
        return tok["input_ids"], tok["attention_mask"]
    tok = tokenize(model, [u[0] for u in units], [u[1] for u in units])
    return tok.input_ids, tok.attention_mask


def _check_features(tc, features) -> List[Tuple[int, int]]:
    out = []
    for item in features:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"features are (layer, feature) pairs, got {item!r}")
        l, i = int(item[0]), int(item[1])
        if l not in tc:
            raise ValueError(f"no transcoder for layer {l}; this set covers layers {tc.layers}")
        if not 0 <= i < tc[l].d_tc:
            raise ValueError(f"feature {i} is out of range for layer {l} (d_tc={tc[l].d_tc})")
        out.append((l, i))
    if not out:
        raise ValueError("no features given: pass (layer, feature) pairs, e.g. [(1, 23)]")
    return list(dict.fromkeys(out))


@torch.no_grad()
@checked_arguments(counts={"k": 1, "batch_size": 1, "context": 0})
def feature_examples(
    model,
    transcoders,
    texts: Any,
    features: Iterable[Tuple[int, int]],
    k: int = 5,
    context: int = 12,
    batch_size: int = 16,
) -> FeatureExamples:
    """The `k` top activating texts of each (layer, feature) in `features` over `texts`, with `context`
    tokens before the most active token (and up to 4 after): one forward per batch of `batch_size` texts,
    stopping after the last layer asked for."""
    feats = _check_features(transcoders, features)
    units, labels = text_units(texts)
    layers = sorted({l for l, _ in feats})
    cols = {l: torch.tensor([i for m, i in feats if m == l]) for l in layers}
    best = {l: torch.full((len(units), len(cols[l])), -float("inf")) for l in layers}
    where = {l: torch.zeros((len(units), len(cols[l])), dtype=torch.long) for l in layers}
    ids: List[List[int]] = [[] for _ in units]
    kinds = [u[1] is None for u in units]
    for bare in (True, False):
        rows = [n for n, b in enumerate(kinds) if b == bare]
        for s in range(0, len(rows), batch_size):
            chunk = rows[s : s + batch_size]
            _scan(model, transcoders, [units[n] for n in chunk], chunk, cols, best, where, ids)
    frame = _top(model, feats, best, where, ids, labels, k, context)
    return FeatureExamples(frame, len(units), k)


def _scan(model, tc, units, rows, cols, best, where, ids) -> None:
    """One batch: each text's largest activation of each feature, and where (in its own tokens)."""
    input_ids, mask = _batch(model, units)
    got: Dict[str, torch.Tensor] = {}

    def grab(t, hook):
        got[hook.name] = t.detach()

    layers = sorted(cols)
    model.run_with_hooks(
        input_ids,
        mask,
        return_type=None,
        fwd_hooks=[(input_hook(l), grab) for l in layers],
        stop_at_layer=max(layers) + 1,
    )
    mask = mask.bool().cpu()
    start = mask.float().argmax(1)  # the first real token: pads lie on one side, on the left by default
    for r, n in enumerate(rows):
        ids[n] = input_ids[r][mask[r].to(input_ids.device)].tolist()
    rows_t = torch.tensor(rows)
    for l in layers:
        t = tc[l]
        x = got[input_hook(l)].float().to(t.W_enc.device)
        acts = t.encode(x)[..., cols[l].to(x.device)].cpu()  # [B, T, n]
        acts = acts.masked_fill(~mask[..., None], -float("inf"))
        value, pos = acts.max(1)
        best[l][rows_t] = value
        where[l][rows_t] = pos - start[:, None]


def _top(model, feats, best, where, ids, labels, k, context) -> pd.DataFrame:
    def piece(tokens: List[int]) -> str:
        if model.tokenizer is None:
            return " ".join(str(t) for t in tokens)
        return "".join(model.tokenizer.decode([t]) for t in tokens)

    out: List[Dict[str, Any]] = []
    for l, i in feats:
        col = [f for f in feats if f[0] == l].index((l, i))  # the order of `cols[l]`
        value = best[l][:, col]
        order = np.argsort(-value.numpy(), kind="stable")[:k]
        for rank, n in enumerate(order):
            act = float(value[n])
            if not act > 0:
                break
            p = int(where[l][n, col])
            toks = ids[n]
            out.append(
                {
                    "component": f"L{l}F{i}",
                    "layer": l,
                    "feature": i,
                    "rank": rank,
                    "text": int(n),
                    "label": labels[n],
                    "position": p,
                    "activation": act,
                    "before": piece(toks[max(0, p - context) : p]),
                    "token": piece(toks[p : p + 1]),
                    "after": piece(toks[p + 1 : p + 5]),
                }
            )
    return pd.DataFrame(out, columns=COLUMNS)
