"""Edge attribution for contrastive pairs: EAP and EAP-IG estimates of readout-aligned path patching
(docs/theory.md, "Edge attribution").

    score(S -> R) = Δ_S . mean_k g_R(x_k)

Δ_S is the sender's readout output, source run minus target run (as `path_patch` adds it); g_R(x) the
gradient of the reward with respect to receiver R's own input at the readout (a head's query, key or value
input, an MLP's input, or the final residual), through R alone with everything downstream recomputed, where
every receiver reads its target residual plus the offset x. alpha_k = (k + 1/2) / steps (midpoint rule).

    eap            x = 0: one gradient at the target run (attribution patching)
    eap-ig         x_k = alpha_k Δ_S in every residual S writes (the sender's own straight line), except for
                   R = readout: x_k = alpha_k (resid_source - resid_target) (the joint line), so that
                   the edges into the readout sum to the whole-residual patch effect (completeness,
                   exact as steps grow; the senders embed + heads + MLPs partition the readout residual)
    eap-ig-joint   the joint line for every receiver
    eap-ig-inputs  (positions="all" only) Hanna et al.'s EAP-IG, the field's standard one: not an offset
                   line but the whole model run at input embeddings e_t + a_k (e_s - e_t),
                   a_k = (steps - k) / steps (from the source, a = 1, towards the target, never at it),
                   g_R the plain gradient there; steps = 1 is the gradient at the source's input alone

Cost per batch: two full forwards (the target with its keys/values, the source), then one-token readout
passes (forward and backward): one row for eap, steps for eap-ig-joint, steps x n_senders for eap-ig (each
sender's rows from its own block on, `max_rows` at a time). At every position eap and eap-ig-inputs run
the columns both sides share once without gradients and only the rest forward and backward
(`shared_prefix`): eap one such pass and the source's forward, eap-ig-inputs one per point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.directions import readout_direction
from reward_lens.core.readout import capture
from reward_lens.data.pairs import as_pairs
from reward_lens.instruments.circuits.graph import (
    TARGET,
    capture_names,
    edge_mask,
    interpolated_adjoints,
    joint_offsets,
    nodes,
    receiver_gradients,
    sender_deltas,
    sender_offsets,
    target_run,
)
from reward_lens.instruments.circuits.positions import (
    full_adjoints,
    joint_offsets_all,
    sender_offsets_all,
    source_run_all,
    target_run_all,
)
from reward_lens.instruments.circuits.shared_prefix import first_difference, prefix_keys_values, suffix_pass
from reward_lens.instruments.patching.path import check_positions, grid_over_batches
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.validation import as_index, check_name_list, checked_arguments, safe_ratio
from reward_lens.plotting import sender_receiver_heatmap
from reward_lens.results import CleanPairRewards, edge_frame, edge_means, to_numpy

EDGE_METHODS = ("eap", "eap-ig", "eap-ig-joint", "eap-ig-inputs")
Edge = Tuple[str, str]


@dataclass
class EdgeAttributionResult(CleanPairRewards):
    """Estimated path-patching effects `scores` [n_pairs, n_senders, n_receivers] (NaN where the receiver
    does not read the sender), in the units of `PathPatchResult.effect()`; `clean_chosen` /
    `clean_rejected` [n_pairs]. normalized_score = score / clean gap (chosen - rejected). `positions`: the
    path-patching definition estimated ("readout" or "all", as `path_patch`)."""

    pair_ids: List[str]
    senders: List[str]
    receivers: List[str]
    mode: str
    method: str
    steps: int
    clean_chosen: Float[torch.Tensor, " pair"]
    clean_rejected: Float[torch.Tensor, " pair"]
    scores: Float[torch.Tensor, "pair sender receiver"]
    positions: str = "readout"

    def normalized(self) -> torch.Tensor:
        return safe_ratio(self.scores, self.clean_gap[:, None, None])  # a tie (no gap): NaN, never ±inf

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, sender, receiver) edge: pair, sender, receiver, mode, method, score,
        clean_gap, normalized_score."""
        s = to_numpy(self.scores)
        columns = {
            "mode": self.mode,
            "method": self.method,
            "score": s,
            "clean_gap": to_numpy(self.clean_gap),
        }
        columns["normalized_score"] = to_numpy(self.normalized())
        return edge_frame(self.pair_ids, self.senders, self.receivers, np.isfinite(s), columns)

    def summary(self) -> pd.DataFrame:
        """Mean (normalised) score per edge over pairs, largest |mean score| first."""
        return edge_means(self.to_frame(), "score")

    def ranking(self) -> List[Edge]:
        """Every edge, largest |mean score over pairs| first."""
        return (
            list(zip(*self.summary()[["sender", "receiver"]].to_numpy().T.tolist())) if self.senders else []
        )

    @checked_arguments(counts={"top_n": 1})
    def circuit(self, top_n: Optional[int] = None, threshold: Optional[float] = None) -> List[Edge]:
        """The edges of the top_n largest |mean score| (all without top_n), those with |mean normalised
        score| >= threshold when given."""
        table = self.summary()
        if threshold is not None:
            table = table[table.mean_normalized_score.abs() >= threshold]
        if top_n is not None:
            table = table.head(top_n)
        return [(s, r) for s, r in zip(table.sender, table.receiver)]

    @checked_arguments(counts={"top_n": 1})
    def html(self, top_n: int = 30) -> str:
        """A self-contained interactive graph of the edges (nodes by layer; width and colour by mean
        score; hover for values; a slider for top-n)."""
        from reward_lens.instruments.circuits.html import circuit_html

        return circuit_html(self, top_n)

    def _repr_html_(self) -> str:
        return self.html()

    @checked_arguments(flags=("normalized",))
    def plot(self, normalized: bool = True, ax=None):
        """Sender x receiver heatmap of the mean (normalised) score over pairs (blank: no such edge)."""
        grid = to_numpy(self.normalized() if normalized else self.scores).mean(0)
        title = (
            f"Edge attribution ({self.method}, {self.mode}, positions={self.positions}), mean over "
            f"{len(self.pair_ids)} pair(s)"
        )
        label = "normalised score" if normalized else "score"
        return sender_receiver_heatmap(grid, self.senders, self.receivers, label, title, ax)


def agreement(exact: torch.Tensor, scores: torch.Tensor, top: int = 20) -> Tuple[float, float]:
    """How well estimated edge scores [pair, sender, receiver] rank and sign exact path-patching effects of
    the same edges: (mean per-pair Spearman over every finite edge, mean per-pair sign agreement on the `top`
    largest |exact| edges), the figures docs/theory.md reports."""
    from scipy.stats import spearmanr  # scipy only where it is used, as stats.py does

    rho, sign = [], []
    for i in range(exact.shape[0]):
        ok = torch.isfinite(exact[i])
        a, b = to_numpy(exact[i][ok]), to_numpy(scores[i][ok])
        rho.append(spearmanr(a, b).correlation)
        big = np.argsort(-np.abs(a))[:top]
        sign.append(float((np.sign(a[big]) == np.sign(b[big])).mean()))
    return float(np.mean(rho)), float(np.mean(sign))


def step_points(method: str, steps: int) -> torch.Tensor:
    """alpha of each gradient: 0 (EAP), (steps - k) / steps (eap-ig-inputs: the way from the target to the
    source) or the midpoints (k + 1/2) / steps (the lines)."""
    if method == "eap":
        return torch.zeros(1)
    if method == "eap-ig-inputs":  # Hanna et al.'s points: from the source (1) towards the target, not at it
        return torch.arange(steps, 0, -1, dtype=torch.float64).float() / steps
    return (torch.arange(steps, dtype=torch.float64) + 0.5).float() / steps


def sender_chunks(model, snodes, chunk: int):
    """(start block, sender indices) chunks: senders grouped by the first block that reads them (embed 0,
    a head or attention of layer l: l, an MLP of layer l: l + 1), at most `chunk` per pass."""
    L = model.cfg.n_layers
    groups = {}
    for i, s in enumerate(snodes):
        start = 0 if s.kind == "embed" else s.layer + (s.kind == "mlp")
        if start < L:  # the last MLP writes only into the readout
            groups.setdefault(start, []).append(i)
    for start, members in sorted(groups.items()):
        for lo in range(0, len(members), chunk):
            yield start, torch.tensor(members[lo : lo + chunk])


def batch_scores(model, batch, snodes, rnodes, mode: str, method: str, alphas: torch.Tensor, max_rows: int):
    """(scores [B, S, R], rewards by side) of one PairBatch."""
    t_side, s_side = TARGET[mode]
    tok, stok = getattr(batch, t_side), getattr(batch, s_side)
    ctx = target_run(model, tok)
    src = capture(model, stok, capture_names(model))
    direction, bias = readout_direction(model, tok)
    delta = sender_deltas(model, snodes, ctx.cap.at_readout, src.at_readout)
    line = "joint" if method in ("eap", "eap-ig-joint") else "sender"
    joint = joint_offsets(model, ctx.cap.at_readout, src.at_readout, alphas)
    grads = receiver_gradients(model, rnodes, interpolated_adjoints(model, ctx, joint, direction, bias)).mean(
        1
    )
    scores = torch.einsum("bsd,brd->bsr", delta, grads)
    if line == "sender":
        own = torch.tensor([j for j, r in enumerate(rnodes) if r.kind != "readout"])  # readout: joint line
        for start, part in sender_chunks(model, snodes, max(1, max_rows // alphas.numel())):
            offsets = sender_offsets(model, [snodes[i] for i in part], delta[:, part], alphas)
            adj = interpolated_adjoints(model, ctx, offsets, direction, bias, start)
            g = receiver_gradients(model, [rnodes[j] for j in own], adj)  # [B, S_part * P, R_own, d]
            g = g.view(g.shape[0], len(part), alphas.numel(), *g.shape[2:]).mean(2)
            scores[:, part[:, None], own[None]] = torch.einsum("bsd,bsrd->bsr", delta[:, part], g)
    scores = scores.cpu()
    scores[:, ~edge_mask(snodes, rnodes)] = float("nan")
    return scores, {t_side: ctx.cap.rewards.float().cpu(), s_side: src.rewards.float().cpu()}


def shared_prefix_scores(model, tok, stok, snodes, rnodes, method: str, alphas: torch.Tensor, max_rows: int):
    """(scores [B, S, R], target rewards, source rewards) of `eap` and `eap-ig-inputs` at every position,
    from the first column where the batch's two sides differ (`shared_prefix`)."""
    direction, bias = readout_direction(model, tok)
    seq = model.sequence_context(tok)
    start = first_difference(tok, stok, seq)
    kv = prefix_keys_values(model, seq, start)
    with torch.no_grad():
        e_t, e_s = model.embed(tok.input_ids[:, start:]), model.embed(stok.input_ids[:, start:])
    tgt, src = {}, {}
    if method == "eap":  # the gradient pass is the target's own forward: its outputs are kept there
        grads = suffix_pass(model, seq, start, kv, e_t, rnodes, direction, bias, record=tgt)
        suffix_pass(model, seq, start, kv, e_s, [], direction, bias, record=src)
    else:  # Hanna et al.'s points e_s + (1 - a)(e_t - e_s); the first, a = 1, is the source's own run
        suffix_pass(model, seq, start, kv, e_t, [], direction, bias, record=tgt)
        B, P = e_t.shape[0], alphas.numel()
        grads = 0.0
        per = max(1, max_rows // B)
        for lo in range(0, P, per):
            a = alphas[lo : lo + per].to(e_t.device, e_t.dtype)
            x0 = e_s[:, None] + (1 - a)[None, :, None, None] * (e_t - e_s)[:, None]
            rows = {} if lo == 0 else None
            x0 = x0.reshape(-1, *e_t.shape[1:])
            grads = grads + suffix_pass(model, seq, start, kv, x0, rnodes, direction, bias, record=rows) / P
            if rows is not None:  # the source's outputs: each pair's first row
                src = {name: t.unflatten(0, (B, -1))[:, 0] for name, t in rows.items()}
    delta = sender_deltas(model, snodes, tgt, src)  # [B, S, T - start, d]
    scores = torch.einsum("bstd,brtd->bsr", delta, grads)
    return scores, tgt["reward"], src["reward"]


def batch_scores_all(
    model, batch, snodes, rnodes, mode: str, method: str, alphas: torch.Tensor, max_rows: int
):
    """`batch_scores` at every position (token-aligned pairs): score = sum over positions of Δ_S . g_R."""
    t_side, s_side = TARGET[mode]
    tok, stok = getattr(batch, t_side), getattr(batch, s_side)
    target_run_all(model, tok, capture_target=False)  # checks the architecture
    if method in ("eap", "eap-ig-inputs"):
        scores, t_rewards, s_rewards = shared_prefix_scores(
            model, tok, stok, snodes, rnodes, method, alphas, max_rows
        )
    else:
        scores, t_rewards, s_rewards = line_scores_all(
            model, tok, stok, snodes, rnodes, method, alphas, max_rows
        )
    scores = scores.cpu()
    scores[:, ~edge_mask(snodes, rnodes)] = float("nan")
    return scores, {t_side: t_rewards.float().cpu(), s_side: s_rewards.float().cpu()}


def line_scores_all(model, tok, stok, snodes, rnodes, method: str, alphas: torch.Tensor, max_rows: int):
    """(scores, target rewards, source rewards) of `eap-ig` and `eap-ig-joint` at every position: the
    straight-through passes over whole sequences (`positions.full_adjoints`); with alphas = [0] (the joint
    line's one point at the target) it is EAP, the reference the shared-prefix pass is tested against."""
    direction, bias = readout_direction(model, tok)
    src = source_run_all(model, stok)
    srcf = src.full
    tcap, seq = target_run_all(model, tok)
    tgt = tcap.full
    grads = 0.0
    per = max(1, max_rows // tok.input_ids.shape[0])
    for lo in range(0, alphas.numel(), per):  # the joint line, `per` points at a time
        part = alphas[lo : lo + per]
        joint = joint_offsets_all(model, tgt, srcf, part)
        g = full_adjoints(model, seq, tgt, joint, rnodes, direction, bias, mean_over=part.numel())
        grads = grads + g[:, 0] * (part.numel() / alphas.numel())
    delta = sender_deltas(model, snodes, tgt, srcf)  # [B, S, T, d]
    B, P = delta.shape[0], alphas.numel()
    scores = torch.einsum("bstd,brtd->bsr", delta, grads)
    if method == "eap-ig":
        own = torch.tensor([j for j, r in enumerate(rnodes) if r.kind != "readout"])  # readout: joint line
        for start, part in sender_chunks(model, snodes, max(1, max_rows // (B * P))):
            offsets = sender_offsets_all(model, [snodes[i] for i in part], delta[:, part], alphas)
            g = full_adjoints(model, seq, tgt, offsets, [rnodes[j] for j in own], direction, bias, start, P)
            scores[:, part[:, None], own[None]] = torch.einsum("bstd,bsrtd->bsr", delta[:, part], g)
    return scores, tcap.rewards, src.rewards


@checked_arguments(counts={"steps": 1, "batch_size": 1, "max_rows": 1})
@with_frozen_weights
def edge_attribution(
    model,
    pairs,
    *,
    method: str = "eap-ig",
    mode: str = "noising",
    steps: int = 16,
    senders: Optional[Sequence[str]] = None,
    receivers: Optional[Sequence[str]] = None,
    positions: str = "readout",
    batch_size: int = 8,
    max_rows: int = 256,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> EdgeAttributionResult:
    """EAP / EAP-IG scores of every (sender, receiver) edge, estimating `path_patch(model, pairs, mode=mode,
    positions=positions)` (module docstring). senders: "embed", "L{l}H{h}", "attn_L{l}", "mlp_L{l}"
    (default: embed, every head, every MLP); receivers: `path_patch`'s (default: all). positions="all":
    token-aligned pairs, every position. method: "eap" (one gradient at the target), "eap-ig" (the
    default: each sender along its own line, the most accurate and, at every position, the most costly),
    "eap-ig-joint" (all senders along one activation line), "eap-ig-inputs" (Hanna et al.'s EAP-IG: the
    input embeddings interpolated, positions="all" only; `steps` forwards and backwards)."""
    if method not in EDGE_METHODS:
        raise ValueError(f"method must be one of {EDGE_METHODS}, got {method!r}")
    if mode not in TARGET:
        raise ValueError(
            f"mode must be one of {tuple(TARGET)} (edges carry a source - target difference), got {mode!r}"
        )
    steps = as_index(steps, "steps", hint=" (the number of interpolation points, e.g. 16)")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    check_name_list("senders", senders, "['embed', 'L0H1']")
    check_name_list("receivers", receivers, "['readout']")
    if not model.has_head_hooks:
        raise ValueError("edge_attribution needs per-head hooks and weights (a native architecture)")
    everywhere = check_positions(positions) == "all"
    if method == "eap-ig-inputs" and not everywhere:
        raise ValueError(
            "method='eap-ig-inputs' interpolates the input embeddings of both sides position by position, "
            "which needs token-aligned pairs and estimates the all-position effect: pass positions='all', "
            "or use method='eap-ig' for the readout-only definition"
        )
    pairs = as_pairs(pairs)
    snodes, rnodes = nodes(model, senders, receivers)
    alphas = step_points(method, steps)
    scores_of = batch_scores_all if everywhere else batch_scores
    # path_patch's harness (grid_over_batches: the loop and the fields both results have; check_positions);
    # the results stay two classes because path_patch returns exact patched rewards and this returns
    # gradient estimates of their effects.
    scores, fields = grid_over_batches(
        model,
        pairs,
        snodes,
        rnodes,
        everywhere,
        lambda batch: scores_of(model, batch, snodes, rnodes, mode, method, alphas, max_rows),
        batch_size=batch_size,
        progress=progress and "edge attribution",
        padding_side=padding_side,
    )
    steps_run = 1 if method == "eap" else steps
    return EdgeAttributionResult(
        mode=mode, method=method, steps=steps_run, scores=scores, positions=positions, **fields
    )
