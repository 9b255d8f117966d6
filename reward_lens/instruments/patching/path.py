"""Readout-aligned path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023).

The effect of the path sender -> receiver: the sender's output difference (source run - target run) is
added to the receiver's input only, every other component keeps its target-run value, and what the
receiver then computes flows on to the reward. Exactly (docs/theory.md, "Path patching"):

    Δ = out_S(source)[readout_s] - out_S(target)[readout_t]                          the sender's difference
    head sender L{l}H{h}: out = z_h W_O[h] (Gemma-2: times (1 + w_post) / s_post, the target's post-norm
    scale);
    attn_L{l} / mlp_L{l} senders: hook_attn_out / hook_mlp_out.

    receiver "readout":       reward(resid_final_t + Δ)   (the final norm recomputed, as the model reads it)
    receiver "L{l}H{h}.q":    head h's query at the readout computed from ln1(resid_pre_t + Δ); its keys and
                              values and every other head from the target run
    receiver "L{l}KV{g}.k"/".v": key/value head g's key (value) at the readout from ln1(resid_pre_t + Δ)
                              (under GQA one key/value head serves n_heads / n_kv query heads: one receiver)
    receiver "mlp_L{l}":      the MLP's output at the readout computed from ln2(resid_mid_t + Δ)

The receiver's new value replaces its target-run value and everything downstream of it is recomputed (as in
Wang et al.'s final step); components between sender and receiver never see Δ. Readout-aligned as `patch`
is: chosen and rejected differ in length, so the sender's readout output is compared across runs, and only
the target's readout token changes. Under causal attention positions before it never see it and the reward
never reads positions after it (a trailing EOS when pad = EOS): the other positions keep their target values
without being frozen explicitly, wherever the readout sits.

Modes: "noising" (target chosen, source rejected) and "denoising" (target rejected, source chosen).
Methods: "naive" runs full forwards with hooks (one to compute the receiver's new value from its input plus
Δ, one with that value written in); "fast" reuses the target run's cache (post-RoPE keys and values of all
other positions) and recomputes only the readout token from the receiver's layer on. They agree within 1e-5
(tested). A receiver must read the residual after the sender writes it (a later layer, or the MLP of the
sender's own attention layer); other cells are NaN.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float

from reward_lens.core.batching import pair_batches
from reward_lens.core.directions import readout_direction, reward_from_final_resid
from reward_lens.core.readout import Capture, Tokenized, capture
from reward_lens.data.pairs import as_pairs, pair_labels
from reward_lens.instruments.patching.contrastive import GapNormalized
from reward_lens.instruments.patching.engines import readout_recompute_exact
from reward_lens.model.frozen import with_frozen_weights
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.recompute import ReadoutContext
from reward_lens.model.validation import check_name_list, checked_arguments
from reward_lens.plotting import sender_receiver_heatmap
from reward_lens.results import edge_frame, edge_means, to_numpy

PATH_MODES = ("noising", "denoising")
PATH_METHODS = ("fast", "naive")
POSITIONS = ("readout", "all")
_TARGET = {"noising": ("chosen", "rejected"), "denoising": ("rejected", "chosen")}  # (target, source)


@dataclass(frozen=True)
class PathNode:
    """A sender (kind "head", "attn", "mlp") or receiver (kind "q", "k", "v", "mlp", "readout") of a path.
    `layer` is the block (None for the readout); `index` the query head (q, head) or key/value head (k, v)."""

    name: str
    kind: str
    layer: Optional[int] = None
    index: Optional[int] = None

    def writes_before(self, receiver: "PathNode") -> bool:
        """Whether this sender's output reaches `receiver`'s input directly (the receiver reads later)."""
        if receiver.kind == "readout":
            return True
        if receiver.kind == "mlp" and self.kind in ("head", "attn"):
            return receiver.layer >= self.layer
        return receiver.layer > self.layer


_SENDER = re.compile(r"^(?:L(\d+)H(\d+)|(attn|mlp)_L(\d+))$")
_RECEIVER = re.compile(r"^(?:L(\d+)H(\d+)\.q|L(\d+)KV(\d+)\.([kv])|mlp_L(\d+)|readout)$")


def _check(cfg, node: PathNode) -> PathNode:
    limit = cfg.n_heads if node.kind in ("head", "q") else cfg.n_key_value_heads
    if node.layer is not None and not 0 <= node.layer < cfg.n_layers:
        raise ValueError(
            f"{node.name}: layer {node.layer} out of range; this model has blocks 0..{cfg.n_layers - 1}"
        )
    if node.index is not None and not 0 <= node.index < limit:
        raise ValueError(f"{node.name}: index {node.index} out of range (0..{limit - 1})")
    return node


def parse_sender(cfg, name: str) -> PathNode:
    """'L{l}H{h}' (a head's output), 'attn_L{l}' or 'mlp_L{l}' (a whole component's output)."""
    m = _SENDER.match(name)
    if not m:
        raise ValueError(f"unknown sender {name!r}; use 'L{{l}}H{{h}}', 'attn_L{{l}}' or 'mlp_L{{l}}'")
    if m.group(1) is not None:
        return _check(cfg, PathNode(name, "head", int(m.group(1)), int(m.group(2))))
    return _check(cfg, PathNode(name, m.group(3), int(m.group(4))))


def parse_receiver(cfg, name: str) -> PathNode:
    """'L{l}H{h}.q', 'L{l}KV{g}.k', 'L{l}KV{g}.v', 'mlp_L{l}' or 'readout' (the direct path)."""
    m = _RECEIVER.match(name)
    if not m:
        raise ValueError(
            f"unknown receiver {name!r}; use 'L{{l}}H{{h}}.q', 'L{{l}}KV{{g}}.k', 'L{{l}}KV{{g}}.v', "
            "'mlp_L{l}' or 'readout'"
        )
    if m.group(1) is not None:
        return _check(cfg, PathNode(name, "q", int(m.group(1)), int(m.group(2))))
    if m.group(3) is not None:
        return _check(cfg, PathNode(name, m.group(5), int(m.group(3)), int(m.group(4))))
    if m.group(6) is not None:
        return _check(cfg, PathNode(name, "mlp", int(m.group(6))))
    return PathNode("readout", "readout")


def default_receivers(cfg) -> List[str]:
    """Every head's query, every key/value head's key and value, every MLP, and the readout."""
    out: List[str] = []
    for l in range(cfg.n_layers):
        out += [f"L{l}H{h}.q" for h in range(cfg.n_heads)]
        out += [f"L{l}KV{g}.{kv}" for kv in ("k", "v") for g in range(cfg.n_key_value_heads)]
        out.append(f"mlp_L{l}")
    return out + ["readout"]


@dataclass
class PathPatchResult(GapNormalized):
    """Patched rewards of the target run per pair, sender and receiver: `patched` [n_pairs, n_senders,
    n_receivers] (NaN where the receiver does not read the sender's output); `clean_chosen` /
    `clean_rejected` [n_pairs]. effect = patched - clean target reward; normalised by the clean gap
    (chosen - rejected), noising -1 means the path carries the whole preference. `positions`: "readout"
    (the sender's difference at the readout only, the readout token recomputed) or "all" (at every
    position, every position of the receiver recomputed); docs/theory.md, "Path patching"."""

    pair_ids: List[str]
    senders: List[str]
    receivers: List[str]
    mode: str
    method: str
    clean_chosen: Float[torch.Tensor, " pair"]
    clean_rejected: Float[torch.Tensor, " pair"]
    patched: Float[torch.Tensor, "pair sender receiver"]
    positions: str = "readout"

    @property
    def target(self) -> str:
        return _TARGET[self.mode][0]

    @checked_arguments(flags=("normalized",))
    def effect(self, normalized: bool = False) -> torch.Tensor:
        clean = self.clean_chosen if self.target == "chosen" else self.clean_rejected
        eff = self.patched - clean[:, None, None]
        return self.per_gap(eff) if normalized else eff  # ties: NaN

    def to_frame(self) -> pd.DataFrame:
        """One row per (pair, sender, receiver) path that exists: pair, sender, receiver, mode, target,
        clean_reward, patched_reward, effect, clean_gap, normalized_effect."""
        p = to_numpy(self.patched)
        columns = {
            "mode": self.mode,
            "target": self.target,
            "clean_reward": to_numpy(self.clean_chosen if self.target == "chosen" else self.clean_rejected),
            "patched_reward": p,
            "effect": to_numpy(self.effect()),
            "clean_gap": to_numpy(self.clean_gap),
            "normalized_effect": to_numpy(self.effect(normalized=True)),
        }
        return edge_frame(self.pair_ids, self.senders, self.receivers, np.isfinite(p), columns)

    def summary(self) -> pd.DataFrame:
        """Mean (normalised) effect per path over pairs, largest |mean effect| first."""
        return edge_means(self.to_frame(), "effect")

    @checked_arguments(flags=("normalized",))
    def plot(self, normalized: bool = True, ax=None):
        """Sender x receiver heatmap of the mean effect over pairs (blank: no such path)."""
        grid = to_numpy(self.effect(normalized=normalized)).mean(0)
        title = (
            f"Path patching ({self.mode}, target {self.target}, positions={self.positions}), mean over "
            f"{len(self.pair_ids)} pair(s)"
        )
        label = "normalised effect" if normalized else "effect"
        return sender_receiver_heatmap(grid, self.senders, self.receivers, label, title, ax)


# ---------------------------------------------------------------------------------------------------
# Sender differences at the readout


def _sender_names(model, senders: Sequence[PathNode]) -> List[str]:
    names = set()
    for s in senders:
        if s.kind == "head":
            names.add(act_name("z", s.layer))
            names.update(model.blocks[s.layer].output_gain_hooks())  # Gemma-2's post-norm scales
        else:
            names.add(act_name(f"{s.kind}_out", s.layer))
    return sorted(names)


def sender_delta(
    model, sender: PathNode, tgt: Dict[str, torch.Tensor], src: Dict[str, torch.Tensor]
) -> torch.Tensor:
    """Δ [B, d_model]: the sender's output at the source readout minus at the target readout, from readout
    activations; [B, T, d_model] at every position from whole-sequence ones (head outputs through Gemma-2's
    post-norm with the target's scale frozen)."""
    if sender.kind != "head":
        name = act_name(f"{sender.kind}_out", sender.layer)
        return src[name] - tgt[name]
    z = act_name("z", sender.layer)
    home = tgt[z].device  # a placed model's weights may live elsewhere: brought to the activations
    W_O = model.blocks[sender.layer].attn.W_O[sender.index].to(home)
    delta = (src[z][..., sender.index, :] - tgt[z][..., sender.index, :]) @ W_O
    gain = model.blocks[sender.layer].output_gain("attn", tgt)  # the target's post-norm scale frozen
    return delta * (gain.to(delta.device) if torch.is_tensor(gain) else gain)


# ---------------------------------------------------------------------------------------------------
# Fast path: the readout token alone, from the receiver's layer on, over the target's cached keys/values


def _context(model, tok: Tokenized, extra: Sequence[str]) -> Tuple[Capture, ReadoutContext]:
    """The target's clean capture (residuals at the readout, `extra`, cached keys/values) and the model's
    readout context over it."""
    L = model.cfg.n_layers
    if not readout_recompute_exact(model, tok):
        raise ValueError(
            "the fast path recomputes the readout alone, but the head's gate reads a position at or "
            "after it (ArmoRM's gating pattern); use method='naive' or select one objective"
        )
    readout_names = [act_name("resid_pre", l) for l in range(L)]
    cap = capture(model, tok, readout_names + [final_resid_name(L)] + list(extra), model.readout_kv_names())
    return cap, model.readout_context(tok, kv=cap.full)


def _fast_receiver(
    model, receiver: PathNode, deltas: torch.Tensor, cap: Capture, ctx: ReadoutContext, direction, bias
) -> torch.Tensor:
    """Patched rewards [B, P] for P sender differences `deltas` [B, P, d] into one receiver: the receiver's
    input is the target's plus Δ, everything else the target's; the model recomputes the readout."""
    cfg, acts = model.cfg, cap.at_readout
    if receiver.kind == "readout":
        final = acts[final_resid_name(cfg.n_layers)][:, None] + deltas
    else:
        l = receiver.layer
        pre = acts[act_name("resid_pre", l)][:, None].expand_as(deltas)
        if receiver.kind == "mlp":
            final = model.readout_with_inputs(ctx, l, pre, mlp_delta=deltas)
        else:
            n = cfg.n_heads if receiver.kind == "q" else cfg.n_key_value_heads
            x = pre[:, :, None].expand(-1, -1, n, -1).clone()  # every head reads the target's residual ...
            x[:, :, receiver.index] = pre + deltas  # ... but the receiver's, which reads Δ too
            final = model.readout_with_inputs(ctx, l, pre, **{f"{receiver.kind}_input": x})
    return reward_from_final_resid(model, final, direction[:, None], bias[:, None])


# ---------------------------------------------------------------------------------------------------
# Naive reference: full forwards with hooks


def _naive_receiver(
    model, receiver: PathNode, delta: torch.Tensor, tok: Tokenized, everywhere: bool = False
) -> torch.Tensor:
    """Patched rewards [B]: a target forward computing the receiver's value from its input + Δ, then a
    target forward with that value written in (everything downstream recomputed). At the readout (Δ
    [B, d]), or with `everywhere` at every position (Δ [B, T, d])."""
    L = model.cfg.n_layers
    B = tok.input_ids.shape[0]
    rows, readout = torch.arange(B, device=tok.input_ids.device), tok.readout.to(tok.input_ids.device)
    at = (slice(None), slice(None)) if everywhere else (rows, readout)

    def add_delta(t, hook):
        t = t.clone()
        t[at] += delta.to(t.dtype)
        return t

    def run(hooks):
        return model.run_with_hooks(
            tok.input_ids, tok.attention_mask, readout_positions=tok.readout, fwd_hooks=hooks
        )

    if receiver.kind == "readout":
        return run([(final_resid_name(L), add_delta)]).float()
    l = receiver.layer
    if receiver.kind == "mlp":
        entry, value_name, index = act_name("resid_mid", l), act_name("mlp_out", l), None
    else:
        entry, value_name, index = act_name("resid_pre", l), act_name(receiver.kind, l), receiver.index
    kept = {}

    where = at if index is None else (*at, index)

    def keep(t, hook):
        kept["value"] = t[where].clone()

    run([(entry, add_delta), (value_name, keep)])

    def write(t, hook):
        t = t.clone()
        t[where] = kept["value"]
        return t

    return run([(value_name, write)]).float()


# ---------------------------------------------------------------------------------------------------
# Every position: token-aligned pairs, the receiver recomputed at every position from its layer on


def check_positions(positions: str) -> str:
    if positions not in POSITIONS:
        raise ValueError(
            f"positions must be one of {POSITIONS} ('readout': the readout token only; 'all': every "
            f"position of token-aligned pairs), got {positions!r}"
        )
    return positions


def token_aligned_batches(model, pairs, batch_size: int, progress, padding_side: Optional[str]):
    """`pair_batches`, after checking (tokenisation only) that every pair's two sides are token-aligned:
    the same length and padding, so position k of one side faces position k of the other."""
    bad = []
    labels = pair_labels(pairs)
    for batch in pair_batches(model, pairs, batch_size, False, padding_side):
        c, r = batch.chosen.attention_mask, batch.rejected.attention_mask
        lc, lr = c.sum(1).tolist(), r.sum(1).tolist()
        same = c.shape == r.shape and bool((c == r).all(1).all())
        if not same:
            rows = range(c.shape[0])
            bad += [(labels[batch.index.start + b], lc[b], lr[b]) for b in rows if lc[b] != lr[b]] or [
                (labels[batch.index.start], lc[0], lr[0])
            ]
    if bad:
        shown = ", ".join(f"{pid} ({a} vs {b} tokens)" for pid, a, b in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"positions='all' needs token-aligned pairs (both sides the same length and padding), but "
            f"pair(s) {shown}{more} differ; use positions='readout' (defined for any lengths) or "
            "reward_lens.attribution_graph for one text at every position"
        )
    return pair_batches(model, pairs, batch_size, progress, padding_side)


def _fast_receiver_all(
    model, receiver: PathNode, deltas, tgt, seq, direction, bias, max_rows: int
) -> torch.Tensor:
    """Patched rewards [B, P] for P sender differences `deltas` [B, P, T, d] added to one receiver's
    input at every position; the model recomputes every position from the receiver's layer on."""
    cfg, L = model.cfg, model.cfg.n_layers
    B, P, T, d = deltas.shape
    rows = torch.arange(B, device=deltas.device)
    if receiver.kind == "readout":
        final = tgt[final_resid_name(L)][rows, seq.readout][:, None] + deltas[rows, :, seq.readout]
        return reward_from_final_resid(model, final, direction[:, None], bias[:, None])
    l = receiver.layer
    pre = tgt[act_name("resid_pre", l)]
    out = []
    for lo in range(0, P, max(1, max_rows // B)):
        d_part = deltas[:, lo : lo + max(1, max_rows // B)]
        n = d_part.shape[1]
        base = pre.repeat_interleave(n, 0)
        shift = d_part.reshape(B * n, T, d).to(base.dtype)
        if receiver.kind == "mlp":
            inputs = {"mlp_delta": shift}
        else:
            heads = cfg.n_heads if receiver.kind == "q" else cfg.n_key_value_heads
            x = base[:, :, None].expand(-1, -1, heads, -1).clone()  # every head reads the target's ...
            x[:, :, receiver.index] += shift  # ... but the receiver, which reads Δ too
            inputs = {f"{receiver.kind}_input": x}
        out.append(model.final_from_layer(seq.repeat(n), l, base, **inputs).view(B, n, d))
    final = torch.cat(out, 1)
    return reward_from_final_resid(model, final, direction[:, None], bias[:, None])


@torch.no_grad()
def _batch_paths_all(model, batch, senders, receivers, mode, method, max_rows: int = 64):
    """`_batch_paths` at every position (token-aligned pairs)."""
    t_side, s_side = _TARGET[mode]
    tok, stok = getattr(batch, t_side), getattr(batch, s_side)
    L = model.cfg.n_layers
    names = _sender_names(model, senders)
    src = capture(model, stok, full_names=names)
    resids = [act_name("resid_pre", l) for l in range(L)] + [final_resid_name(L)]
    tcap = capture(model, tok, full_names=sorted(set(names + resids)))
    B = tok.input_ids.shape[0]
    deltas = torch.stack([sender_delta(model, s, tcap.full, src.full) for s in senders], 1)  # [B, S, T, d]
    out = torch.full((B, len(senders), len(receivers)), float("nan"))
    if method == "fast":
        direction, bias = readout_direction(model, tok)
        seq = model.sequence_context(tok)
    for j, r in enumerate(receivers):
        valid = [i for i, s in enumerate(senders) if s.writes_before(r)]
        if not valid:
            continue
        if method == "fast":
            got = _fast_receiver_all(model, r, deltas[:, valid], tcap.full, seq, direction, bias, max_rows)
            out[:, valid, j] = got.float().cpu()
        else:
            for i in valid:
                out[:, i, j] = _naive_receiver(model, r, deltas[:, i], tok, everywhere=True).cpu()
    return out, {t_side: tcap.rewards.float().cpu(), s_side: src.rewards.float().cpu()}


# ---------------------------------------------------------------------------------------------------
# The instrument


@torch.no_grad()
def _batch_paths(
    model, batch, senders, receivers, mode, method
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    t_side, s_side = _TARGET[mode]
    tok, stok = getattr(batch, t_side), getattr(batch, s_side)
    names = _sender_names(model, senders)
    src = capture(model, stok, readout_names=names)
    B = tok.input_ids.shape[0]
    if method == "fast":
        cap, ctx = _context(model, tok, names)
        tgt, rewards = cap.at_readout, cap.rewards
        direction, bias = readout_direction(model, tok)
    else:
        tcap = capture(model, tok, readout_names=names)
        tgt, rewards = tcap.at_readout, tcap.rewards
    out = torch.full((B, len(senders), len(receivers)), float("nan"))
    deltas = [sender_delta(model, s, tgt, src.at_readout) for s in senders]
    for j, r in enumerate(receivers):
        valid = [i for i, s in enumerate(senders) if s.writes_before(r)]
        if not valid:
            continue
        if method == "fast":
            d = torch.stack([deltas[i] for i in valid], 1)
            out[:, valid, j] = _fast_receiver(model, r, d, cap, ctx, direction, bias).float().cpu()
        else:
            for i in valid:
                out[:, i, j] = _naive_receiver(model, r, deltas[i], tok).cpu()
    return out, {t_side: rewards.float().cpu(), s_side: src.rewards.float().cpu()}


@checked_arguments(counts={"batch_size": 1})
@with_frozen_weights
def path_patch(
    model,
    pairs,
    senders: Optional[Sequence[str]] = None,
    receivers: Optional[Sequence[str]] = None,
    *,
    mode: str = "noising",
    method: str = "fast",
    positions: str = "readout",
    batch_size: int = 8,
    padding_side: Optional[str] = None,
    progress: Union[bool, str] = False,
) -> PathPatchResult:
    """Path patching of every (sender, receiver) path (module docstring; docs/theory.md).

    senders: 'L{l}H{h}', 'attn_L{l}', 'mlp_L{l}' (default: every head). receivers: 'L{l}H{h}.q',
    'L{l}KV{g}.k', 'L{l}KV{g}.v', 'mlp_L{l}', 'readout' (default: all of them). mode: 'noising' or
    'denoising'. method: 'fast' (default) or 'naive' (full forwards; the reference). positions:
    'readout' (default: the sender's difference at the readout, the readout token recomputed; any
    lengths) or 'all' (Wang et al.'s path patching: the difference at every position, the receiver and
    everything after it recomputed at every position; token-aligned pairs only, else a ValueError).
    """
    cfg = model.cfg
    if not model.has_head_hooks:
        raise ValueError(
            "path_patch needs per-head hooks and weights (a native architecture); this model runs on the "
            "generic component-level path: use patch(model, pairs, level='component') instead"
        )
    if mode not in PATH_MODES:
        raise ValueError(
            f"mode must be one of {PATH_MODES} (path patching adds a source - target difference), got "
            f"{mode!r}"
        )
    if method not in PATH_METHODS:
        raise ValueError(f"method must be one of {PATH_METHODS}, got {method!r}")
    check_positions(positions)
    check_name_list("senders", senders)
    check_name_list("receivers", receivers)
    pairs = as_pairs(pairs)
    snodes = [
        parse_sender(cfg, s)
        for s in (senders or [f"L{l}H{h}" for l in range(cfg.n_layers) for h in range(cfg.n_heads)])
    ]
    rnodes = [parse_receiver(cfg, r) for r in (receivers or default_receivers(cfg))]
    everywhere = positions == "all"
    batch_paths = _batch_paths_all if everywhere else _batch_paths
    patched, fields = grid_over_batches(
        model,
        pairs,
        snodes,
        rnodes,
        everywhere,
        lambda batch: batch_paths(model, batch, snodes, rnodes, mode, method),
        batch_size=batch_size,
        progress=progress and "path patching",
        padding_side=padding_side,
    )
    return PathPatchResult(mode=mode, method=method, patched=patched, positions=positions, **fields)


def grid_over_batches(
    model,
    pairs,
    senders: Sequence[PathNode],
    receivers: Sequence[PathNode],
    everywhere: bool,
    step: Callable[[Any], Tuple[torch.Tensor, Dict[str, torch.Tensor]]],
    *,
    batch_size: int,
    progress: Union[bool, str],
    padding_side: Optional[str],
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """A [pair, sender, receiver] grid over all pairs, and the result fields every such grid has: pair_ids,
    senders and receivers (names), clean_chosen and clean_rejected [n_pairs]. `step(batch)` gives one
    batch's (grid, {side: rewards}); batches are token-aligned when `everywhere` (circuits at every
    position). Path patching and edge attribution (its estimate) share this loop."""
    grids, clean = [], {"chosen": [], "rejected": []}
    batches = (token_aligned_batches if everywhere else pair_batches)(
        model, pairs, batch_size, progress, padding_side
    )
    for batch in batches:
        grid, rewards = step(batch)
        grids.append(grid)
        for side, r in rewards.items():
            clean[side].append(r)
    return torch.cat(grids), {
        "pair_ids": pair_labels(pairs),
        "senders": [s.name for s in senders],
        "receivers": [r.name for r in receivers],
        "clean_chosen": torch.cat(clean["chosen"]),
        "clean_rejected": torch.cat(clean["rejected"]),
    }
