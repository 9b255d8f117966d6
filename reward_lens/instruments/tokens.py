"""Exact token-level attribution: which tokens the reward reads, head by head.

With the final norm's scale s frozen at its real value, the reward is linear in the final residual at the
readout r (`reward = w . resid_final[r] / s + b`, `w` = `model.reward_direction`, or ArmoRM's per-sequence
`model.reward_direction_for`). The final residual at r is the embedding of the readout token plus every
layer's attention and MLP output at r, and each attention head's output at r is a pattern-weighted sum over
source positions:

    head_{l,h}(r) = sum_src pattern_{l,h}[r, src] . v_{l, kv(h)}[src] . W_O[l, h]        (+ b_O per layer)

(GQA: query head h reads key/value head h // (n_heads / n_kv)). So the reward splits exactly into

    reward = embed(r) + sum_l mlp_l(r) + sum_l b_O,l + sum_{l, h, src} head_{l,h}(src -> r) + b

each term dotted with w / s. Gemma-2's post-norms are linear once their real scale is frozen, so the
per-(head, src) terms pass through them with the gain (1 + w_post) / s_post; soft-caps and sliding windows
only change the pattern, which is read from the run itself.

What a term means. `head_{l,h}(src -> r)` is the *direct one-hop read* of the value vector at `src` into the
readout by head l.h: how much of the reward is carried by what that head copied from that position. The
value at `src` is the residual of layer l at `src`, which already mixes earlier tokens; multi-hop effects
(token A moved to B by an earlier head, then read from B) stay in the later head's term at B, and
computation at the readout stays in the MLP terms. It is exact (the terms sum to the reward), not a
gradient: gradient x input (`d reward / d embedding . embedding`) linearises the whole network around the
input, so its token scores neither sum to the reward nor say through which head a token is read.
"""

from __future__ import annotations

import html as html_lib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.directions import readout_direction
from reward_lens.core.pipeline import Reads, Shared, Spec, run_spec
from reward_lens.core.readout import Capture, Tokenized, batches, capture, tokenize
from reward_lens.data.pairs import PreferencePair, TokenPair, as_pairs, pair_labels
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.hooks import act_name
from reward_lens.model.tokenization import is_messages
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import pyplot
from reward_lens.results import to_numpy

SIDES_PAIR = ("chosen", "rejected")


@dataclass
class TokenAttributionResult:
    """Exact per-(layer, head, source token) terms of each sequence's reward.

    Per side ("chosen"/"rejected" for pairs, "text" for single responses), lists over pairs/texts:
    `heads[side][i]` [n_layers, n_heads, n_tokens_i] the head terms over source tokens (pads removed,
    position 0 = first real token), `tokens[side][i]` the token strings, `readout[side][i]` the readout's
    position; tensors over pairs: `embed[side]` [n] (the readout token's embedding), `mlp[side]` and
    `b_O[side]` [n, n_layers] (terms at the readout), `bias[side]` [n], `reward[side]` [n] the model's
    rewards. Identity: heads.sum() + b_O.sum() + mlp.sum() + embed + bias == reward.
    `prompt_len[i]`: shared prompt tokens of pair i (pairs only).
    """

    pair_ids: List[str]
    sides: Tuple[str, ...]
    tokens: Dict[str, List[List[str]]]
    heads: Dict[str, List[torch.Tensor]]
    readout: Dict[str, List[int]]
    embed: Dict[str, torch.Tensor]
    mlp: Dict[str, torch.Tensor]
    b_O: Dict[str, torch.Tensor]
    bias: Dict[str, torch.Tensor]
    reward: Dict[str, torch.Tensor]
    prompt_len: Optional[torch.Tensor] = None
    meta: Dict[str, object] = field(default_factory=dict)

    # ------------------------------------------------------------------ numbers
    def total(self, side: str) -> Float[torch.Tensor, " n"]:
        """Σ of every term + bias per sequence (equals `reward[side]` up to fp32 rounding)."""
        heads = torch.stack([h.double().sum() for h in self.heads[side]])
        return (
            heads
            + self.b_O[side].double().sum(-1)
            + self.mlp[side].double().sum(-1)
            + self.embed[side].double()
            + self.bias[side].double()
        )

    def max_relative_error(self) -> float:
        """max over sequences of |Σ terms + bias - reward| / max(|reward|, 1e-6)."""
        errs = [
            (
                (self.total(s) - self.reward[s].double()).abs()
                / self.reward[s].double().abs().clamp(min=1e-6)
            ).max()
            for s in self.sides
        ]
        return float(max(errs))

    def token_values(
        self, side: str, i: int, layers: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None
    ) -> np.ndarray:
        """[n_tokens] head terms of sequence i summed over the chosen layers and heads (default all)."""
        h = self.heads[side][i]
        if layers is not None:
            h = h[list(layers)]
        if heads is not None:
            h = h[:, list(heads)]
        return to_numpy(h.sum((0, 1)))

    # ------------------------------------------------------------------ frames
    def to_frame(self) -> pd.DataFrame:
        """Tidy: one row per term. Columns pair, side, position, token, term ("head", "b_O", "mlp",
        "embed", "bias"), layer, head, value. Per (pair, side) the values sum to the reward."""
        frames = []
        for side in self.sides:
            for i, pid in enumerate(self.pair_ids):
                h = to_numpy(self.heads[side][i])  # [L, H, T]
                L, H, T = h.shape
                toks = self.tokens[side][i]
                r = self.readout[side][i]
                frames.append(
                    pd.DataFrame(
                        {
                            "pair": pid,
                            "side": side,
                            "position": np.tile(np.arange(T), L * H),
                            "token": [toks[t] for t in range(T)] * (L * H),
                            "term": "head",
                            "layer": np.repeat(np.arange(L), H * T),
                            "head": np.tile(np.repeat(np.arange(H), T), L),
                            "value": h.ravel(),
                        }
                    )
                )
                local = [("b_O", l, float(self.b_O[side][i, l])) for l in range(L)]
                local += [("mlp", l, float(self.mlp[side][i, l])) for l in range(L)]
                local += [
                    ("embed", None, float(self.embed[side][i])),
                    ("bias", None, float(self.bias[side][i])),
                ]
                frames.append(
                    pd.DataFrame(
                        {
                            "pair": pid,
                            "side": side,
                            "position": [r] * (len(local) - 1) + [None],
                            "token": [toks[r]] * (len(local) - 1) + [None],
                            "term": [t for t, _, _ in local],
                            "layer": [l for _, l, _ in local],
                            "head": None,
                            "value": [v for _, _, v in local],
                        }
                    )
                )
        out = pd.concat(frames, ignore_index=True)
        for col in ("position", "layer", "head"):
            out[col] = out[col].astype("Int64")
        return out

    def token_totals(
        self, layers: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None
    ) -> pd.DataFrame:
        """Per token: the head terms summed over layers and heads (optionally only some). Columns pair,
        side, position, token, region ("prompt"/"response" for pairs), value."""
        rows = []
        for side in self.sides:
            for i, pid in enumerate(self.pair_ids):
                vals = self.token_values(side, i, layers, heads)
                p = int(self.prompt_len[i]) if self.prompt_len is not None else None
                for t, (tok, v) in enumerate(zip(self.tokens[side][i], vals)):
                    region = None if p is None else ("prompt" if t < p else "response")
                    rows.append((pid, side, t, tok, region, float(v)))
        return pd.DataFrame(rows, columns=["pair", "side", "position", "token", "region", "value"])

    def gap_frame(
        self, layers: Optional[Sequence[int]] = None, heads: Optional[Sequence[int]] = None
    ) -> pd.DataFrame:
        """Chosen minus rejected, aligned on the shared prompt: prompt token k of chosen against prompt
        token k of rejected (gap = their difference), then the response tokens of both sides by offset
        into the response (their values side by side; gap is NaN there: different tokens)."""
        if self.sides != SIDES_PAIR:
            raise ValueError(
                "gap_frame needs preference pairs (chosen and rejected); these were single texts"
            )
        rows = []
        for i, pid in enumerate(self.pair_ids):
            c, r = (
                self.token_values("chosen", i, layers, heads),
                self.token_values("rejected", i, layers, heads),
            )
            tc, tr = self.tokens["chosen"][i], self.tokens["rejected"][i]
            p = int(self.prompt_len[i])
            for k in range(p):
                rows.append((pid, "prompt", k, tc[k], tr[k], c[k], r[k], c[k] - r[k]))
            for k in range(max(len(c), len(r)) - p):
                get = lambda toks, v: (toks[p + k], v[p + k]) if p + k < len(v) else (None, np.nan)  # noqa: E731
                (a, va), (b, vb) = get(tc, c), get(tr, r)
                rows.append((pid, "response", k, a, b, va, vb, np.nan))
        return pd.DataFrame(
            rows,
            columns=[
                "pair",
                "region",
                "offset",
                "token_chosen",
                "token_rejected",
                "chosen",
                "rejected",
                "gap",
            ],
        )

    def summary(self) -> pd.DataFrame:
        """One row per (pair, side): reward, the token (head) terms in the prompt and the response, the
        readout-local terms (embed, MLPs, b_O), bias, the largest token term, and the identity's error."""
        rows = []
        for side in self.sides:
            for i, pid in enumerate(self.pair_ids):
                vals = self.token_values(side, i)
                p = int(self.prompt_len[i]) if self.prompt_len is not None else 0
                top = int(np.argmax(vals))
                err = abs(float(self.total(side)[i]) - float(self.reward[side][i]))
                rows.append(
                    {
                        "pair": pid,
                        "side": side,
                        "reward": float(self.reward[side][i]),
                        "prompt_tokens": float(vals[:p].sum()),
                        "response_tokens": float(vals[p:].sum()),
                        "embed": float(self.embed[side][i]),
                        "mlp": float(self.mlp[side][i].sum()),
                        "b_O": float(self.b_O[side][i].sum()),
                        "bias": float(self.bias[side][i]),
                        "top_token": self.tokens[side][i][top],
                        "top_value": float(vals[top]),
                        "relative_error": err / max(abs(float(self.reward[side][i])), 1e-6),
                    }
                )
        return pd.DataFrame(rows)

    @checked_arguments(counts={"k": 1})
    def largest_gaps(self, k: int = 4) -> List[int]:
        """Indices of the k pairs with the largest |reward gap| (pairs) or |reward| (texts)."""
        score = (
            (self.reward["chosen"] - self.reward["rejected"])
            if self.sides == SIDES_PAIR
            else self.reward["text"]
        )
        return [int(i) for i in torch.argsort(score.abs(), descending=True)[:k]]

    # ------------------------------------------------------------------ views
    def plot(self, pair: int = 0, side: Optional[str] = None, ax=None):
        """Layer x token heatmap of one sequence's head terms (summed over heads), diverging colours."""
        plt = pyplot()
        side = side or self.sides[0]
        grid = to_numpy(self.heads[side][pair].sum(1))  # [L, T]
        toks = self.tokens[side][pair]
        fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(max(6, 0.28 * len(toks)), 3))
        lim = float(np.abs(grid).max()) or 1.0
        im = ax.imshow(grid, aspect="auto", cmap="RdBu", vmin=-lim, vmax=lim)
        ax.set_xticks(range(len(toks)))
        ax.set_xticklabels([_display(t) for t in toks], rotation=90, fontsize=7)
        ax.set_yticks(range(grid.shape[0]))
        ax.set_yticklabels([f"L{l}" for l in range(grid.shape[0])])
        if self.prompt_len is not None:
            ax.axvline(int(self.prompt_len[pair]) - 0.5, color="black", lw=0.8)
        fig.colorbar(im, ax=ax, label="reward term")
        ax.set_title(f"{self.pair_ids[pair]} ({side}): which tokens each layer's heads read into the reward")
        fig.tight_layout()
        return fig

    @checked_arguments(counts={"max_pairs": 1})
    def html(
        self,
        pairs: Optional[Sequence[int]] = None,
        layers: Optional[Sequence[int]] = None,
        heads: Optional[Sequence[int]] = None,
        max_pairs: int = 20,
    ) -> str:
        """A self-contained token heatmap (HTML fragment with inline styles): chosen and rejected side by
        side, blue = raises the reward, red = lowers it, the value on hover; `layers`/`heads` filter the
        head terms shown. `pairs` (indices) default to the first `max_pairs`."""
        idx = list(range(len(self.pair_ids)))[:max_pairs] if pairs is None else list(pairs)
        what = (
            "all heads"
            if layers is None and heads is None
            else f"layers {layers or 'all'}, heads {heads or 'all'}"
        )
        out = [
            '<div class="rl-tokens" style="font-family:system-ui,sans-serif;font-size:13px">'
            f'<p style="color:#555">Direct read of each token into the reward ({what}); blue raises, red '
            "lowers the reward; hover a token for its value. Colours are scaled per pair.</p>"
        ]
        for i in idx:
            vals = {s: self.token_values(s, i, layers, heads) for s in self.sides}
            lim = max(float(np.abs(v).max()) for v in vals.values()) or 1.0
            cells = "".join(
                '<td style="vertical-align:top;padding:4px 8px;border:1px solid '
                f'#ddd;width:{100 // len(self.sides)}%">'
                f"<b>{s}</b> reward "
                f"{float(self.reward[s][i]):+.4f}<br>{_spans(self.tokens[s][i], vals[s], lim)}</td>"
                for s in self.sides
            )
            out.append(
                f'<p style="margin:10px 0 2px"><b>{html_lib.escape(self.pair_ids[i])}</b></p><table '
                f'style="border-collapse:collapse;width:100%"><tr>{cells}</tr></table>'
            )
        return "".join(out) + "</div>"

    def _repr_html_(self) -> str:
        return self.html(max_pairs=5)


def _display(token: str) -> str:
    return token.replace("\n", "\u23ce").replace(" ", "\u00b7") if token.strip() == "" else token


def _spans(tokens: Sequence[str], values: np.ndarray, lim: float) -> str:
    parts = []
    for t, (tok, v) in enumerate(zip(tokens, values)):
        a = min(abs(float(v)) / lim, 1.0)
        rgb = "33,102,172" if v >= 0 else "178,24,43"
        parts.append(
            f'<span title="position {t}: {float(v):+.5f}" '
            f'style="background:rgba({rgb},{a:.3f});padding:1px '
            f'0;white-space:pre-wrap">{html_lib.escape(_display(tok))}</span>'
        )
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------
# Computation


def _token_strings(model, ids: torch.Tensor) -> List[str]:
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        return [str(int(i)) for i in ids]
    return [tokenizer.decode([int(i)]) for i in ids]


def supports_token_attribution(model) -> bool:
    """Whether the model exposes per-head attention patterns and values (native architectures)."""
    return model.has_head_hooks


def check_token_level(model) -> None:
    """A clear error when the model has no per-head attention patterns and values (the generic path)."""
    if not supports_token_attribution(model):
        raise ValueError(
            "token_attribution needs per-head attention patterns and values, which this model (the "
            "generic component-level path) does not expose; use attribute(model, pairs) for exact "
            "attention-layer terms, or load a natively supported architecture"
        )


def token_reads(model) -> Tuple[List[str], List[str]]:
    """(hooks read at the readout, hooks read whole): patterns at the readout query, values whole."""
    L = model.cfg.n_layers
    readout_names = [act_name("embed"), act_name("final_scale")] + [act_name("mlp_out", l) for l in range(L)]
    readout_names += [
        name for block in model.blocks for name in block.output_gain_hooks()
    ]  # post-norm scales
    readout_names += [act_name("pattern", l) for l in range(L)]
    return readout_names, [act_name("v", l) for l in range(L)]


def token_terms(model, tok: Tokenized) -> Dict[str, torch.Tensor]:
    """The exact terms of one tokenised batch: heads [B, L, H, T] (padded positions hold 0), embed [B],
    mlp [B, L], b_O [B, L], bias [B], reward [B] (float32)."""
    cap = capture(model, tok, *token_reads(model))
    return terms_from_capture(model, cap, *readout_direction(model, tok))


@torch.no_grad()
def terms_from_capture(
    model, cap: Capture, direction: torch.Tensor, bias: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """`token_terms` from a capture holding `token_reads`."""
    cfg, L = model.cfg, model.cfg.n_layers
    acts = {**cap.at_readout, **cap.full}
    rewards = cap.rewards
    # float64 for the products, so the terms' own rounding stays far below the model's fp32 rounding
    w = (
        direction.double() / acts[act_name("final_scale")].double()
    )  # [B, d]: the map every readout term goes through
    group = cfg.n_heads // cfg.n_key_value_heads

    def term(x: torch.Tensor) -> torch.Tensor:
        return (x.double() * w).sum(-1).float()

    heads, b_O = [], []
    for l in range(L):
        attn = model.blocks[l].attn
        # Gemma-2: out = raw / s_post * (offset + w_post), linear with s_post frozen (1 without post-norms)
        wl = w * torch.as_tensor(model.blocks[l].output_gain("attn", acts)).double().to(w.device)
        read = torch.einsum(
            "nhd,bd->bnh", attn.W_O.double().to(w.device), wl
        )  # [B, H, d_head]: W_O[h] . w per head
        v = acts[act_name("v", l)].double().repeat_interleave(group, dim=2)  # [B, T, H, d_head]
        vr = torch.einsum("bthd,bhd->bht", v, read)  # what each source's value would add if fully attended
        heads.append((acts[act_name("pattern", l)].double() * vr).float())
        b_O.append((attn.b_O.double().to(wl.device) * wl).sum(-1).float())
    return {
        "heads": torch.stack(heads, 1),
        "b_O": torch.stack(b_O, 1),
        "embed": term(acts[act_name("embed")]),
        "mlp": torch.stack([term(acts[act_name("mlp_out", l)]) for l in range(L)], 1),
        "bias": bias,
        "reward": rewards.float(),
    }


class TokenSpec(Spec):
    """Token attribution of both responses as a pipeline instrument: reads the attention patterns at
    the readout query and the values whole. Its result: the per-batch pieces (rows with pads removed),
    in pair order, which `token_attribution` assembles."""

    name = "tokens"

    def reads(self, model, batch) -> Reads:
        readout_names, full_names = token_reads(model)
        return Reads.both(readout=readout_names, full=full_names)

    def step(self, model, shared: Shared) -> Dict[str, object]:
        piece: Dict[str, object] = {"prompt_len": shared.batch.prompt_len.cpu()}
        for side in SIDES_PAIR:
            cap = shared.caps[side]
            keys = ("heads", "tokens", "readout", "embed", "mlp", "b_O", "bias", "reward")
            rows: Dict[str, list] = {k: [] for k in keys}
            _split_rows(model, cap.tok, terms_from_capture(model, cap, *shared.direction(model, side)), rows)
            piece[side] = rows
        return piece

    def finish(self, model, pieces, pair_ids):
        return pieces


def _split_rows(model, tok: Tokenized, terms: Dict[str, torch.Tensor], out: Dict[str, list]) -> None:
    """Append each row's terms with pads removed (positions renumbered from the first real token)."""
    for b in range(tok.input_ids.shape[0]):
        keep = tok.attention_mask[b].bool()
        out["heads"].append(terms["heads"][b][..., keep.to(terms["heads"].device)].cpu())
        out["tokens"].append(_token_strings(model, tok.input_ids[b][keep].cpu()))
        out["readout"].append(int(keep[: int(tok.readout[b])].sum()))
    for key in ("embed", "mlp", "b_O", "bias", "reward"):
        out[key].append(terms[key].cpu())


def _is_text(x) -> bool:
    """Text, chat messages, or no messages ([]: the empty response after a whole conversation)."""
    return isinstance(x, str) or is_messages(x) or (isinstance(x, (list, tuple)) and len(x) == 0)


def _is_text_input(x) -> bool:
    """(prompt, response): each text or chat messages; the response may be None (the prompt is then the
    whole text or conversation, as `to_tokens` takes it)."""
    return (
        isinstance(x, (tuple, list)) and len(x) == 2 and _is_text(x[0]) and (x[1] is None or _is_text(x[1]))
    )


def _as_inputs(pairs_or_texts):
    """(pairs, None) for preference pairs / a path; (None, [(prompt, response)]) for texts."""
    if (
        isinstance(pairs_or_texts, (list, tuple))
        and pairs_or_texts
        and all(_is_text_input(x) for x in pairs_or_texts)
    ):
        return None, [(p, ([] if is_messages(p) else "") if r is None else r) for p, r in pairs_or_texts]
    if (
        isinstance(pairs_or_texts, (PreferencePair, TokenPair, str))
        or hasattr(pairs_or_texts, "__fspath__")
        or isinstance(pairs_or_texts, (list, tuple))
    ):
        return as_pairs(pairs_or_texts), None
    raise TypeError(
        "token_attribution takes preference pairs (or a pairs file) or a list of (prompt, response) tuples"
    )


@checked_arguments(counts={"batch_size": 1})
@with_frozen_weights
def token_attribution(
    model,
    pairs_or_texts: Union[Sequence[PreferencePair], Sequence[TokenPair], Sequence[Tuple[str, str]], str],
    *,
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> TokenAttributionResult:
    """Exact token-level attribution of each reward: per (layer, head, source token) terms of the direct
    one-hop read into the readout, plus the readout-local terms (embed, MLP outputs, b_O) and the bias,
    summing to the model's reward (module docstring). Give preference pairs (chosen and rejected, aligned
    on the shared prompt in `gap_frame`) or a list of (prompt, response) tuples (side "text").

    Needs per-head patterns (native architectures); the generic path raises a clear error.
    """
    check_token_level(model)
    pairs, texts = _as_inputs(pairs_or_texts)
    sides = SIDES_PAIR if pairs is not None else ("text",)
    parts = {
        s: {k: [] for k in ("heads", "tokens", "readout", "embed", "mlp", "b_O", "bias", "reward")}
        for s in sides
    }
    prompt_len: List[torch.Tensor] = []
    if pairs is not None:
        pieces = run_spec(
            model,
            pairs,
            TokenSpec(),
            batch_size=batch_size,
            padding_side=padding_side,
            progress=progress and "token attribution",
        )
        for piece in pieces:
            for side in sides:
                for k, v in piece[side].items():
                    parts[side][k] += v
            prompt_len.append(piece["prompt_len"])
        labels = pair_labels(pairs)
    else:
        for sl in batches(len(texts), batch_size, progress and "token attribution"):
            chunk = texts[sl]
            tok = tokenize(model, [p for p, _ in chunk], [r for _, r in chunk], padding_side)
            _split_rows(model, tok, token_terms(model, tok), parts["text"])
        labels = [str(i) for i in range(len(texts))]
    cat = {s: {k: torch.cat(parts[s][k]) for k in ("embed", "mlp", "b_O", "bias", "reward")} for s in sides}
    return TokenAttributionResult(
        pair_ids=labels,
        sides=sides,
        tokens={s: parts[s]["tokens"] for s in sides},
        heads={s: parts[s]["heads"] for s in sides},
        readout={s: parts[s]["readout"] for s in sides},
        embed={s: cat[s]["embed"] for s in sides},
        mlp={s: cat[s]["mlp"] for s in sides},
        b_O={s: cat[s]["b_O"] for s in sides},
        bias={s: cat[s]["bias"] for s in sides},
        reward={s: cat[s]["reward"] for s in sides},
        prompt_len=torch.cat(prompt_len) if prompt_len else None,
    )
