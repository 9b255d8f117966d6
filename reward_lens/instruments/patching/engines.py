"""Patching engines: each returns the patched rewards [batch, n_sites] of one target batch.

readout (the KV-cache fast path): a readout-position patch at layer l changes the readout token from l on,
and under causal attention only positions after it besides; the reward reads the readout alone (a gated
head also reads its gate position, which must precede the readout), so those later positions (a trailing
EOS when pad = EOS, tokens after an inner pad id) are irrelevant and the readout need not be the last
attended token. The target's post-RoPE keys and values are cached in its one clean run; every patch of a
sweep is one alternative residual the model recomputes alone from where the patch enters
(`model.readout_sweep` over `model.readout_context`, `reward_lens.model.recompute`): this module says what
is substituted where and how it is reduced, the model does every positional and attention step.
layer: multi-position patches rerun the forward from the patched layer on the cached clean residual.
naive: one full `run_with_hooks` forward per patch (the reference).

`patch_batch` runs every mode of one batch of pairs and returns a `BatchPatches`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from reward_lens.core.batching import PairBatch, Tokenized
from reward_lens.core.directions import readout_direction, reward_from_final_resid
from reward_lens.core.readout import Capture, capture
from reward_lens.instruments.patching.positions import Positions, patch_positions, site_values
from reward_lens.instruments.patching.spec import SOURCE, TARGETS
from reward_lens.instruments.sites import Site
from reward_lens.model.hooks import act_name, resid_entering
from reward_lens.model.recompute import MID, PRE, ReadoutEntry


@dataclass
class BatchPatches:
    """One batch of pairs patched in every mode: `patched[(mode, target)]` [batch, n_sites]; the clean
    rewards; the captures of the clean runs; for the readout engine, `entries[(mode, target)]` (one
    ReadoutEntry per site), `final[(mode, target)]` [batch, n_sites, d_model] the final residuals and, where
    the memo was asked for them, `changes[(mode, target)]` [batch, n_sites, n_layers, d_model]."""

    patched: Dict[Tuple[str, str], torch.Tensor]
    clean_chosen: torch.Tensor
    clean_rejected: torch.Tensor
    captures: Dict[str, Capture]
    entries: Dict[Tuple[str, str], List[ReadoutEntry]] = field(default_factory=dict)
    final: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)
    changes: Dict[Tuple[str, str], torch.Tensor] = field(default_factory=dict)


def has_readout_fast_path(model) -> bool:
    """Whether the model's blocks have a one-token readout step (native architectures; the generic path
    runs transformers' own layers and takes the `start_at_layer` route instead)."""
    return model.has_readout_fast_path


def readout_recompute_exact(model, tok: Tokenized) -> bool:
    """Whether recomputing the readout token alone gives the patched reward exactly: the model has a
    readout step and every other position the head reads (a gate's) precedes the readout. Positions after
    the readout never matter (causal attention), so where the readout sits among them does not."""
    if not model.has_readout_fast_path:
        return False
    context = model.reward_head.context_positions(tok.input_ids)
    return context is None or bool((context.to(tok.readout.device) < tok.readout).all())


def readout_capture_names(model, sites: Sequence[Site]) -> Tuple[List[str], List[str]]:
    """(names kept at the readout, names kept whole) the readout engine needs from a target's clean run."""
    L = model.cfg.n_layers
    at_readout = [act_name("resid_pre", l) for l in range(L)] + [act_name("resid_mid", l) for l in range(L)]
    at_readout.append(resid_entering(L, L))
    at_readout += sorted({act_name("z", s.layer) for s in sites if s.kind == "head"})
    return at_readout, model.readout_kv_names()


def readout_entries(
    model, tcap: Capture, sites: Sequence[Site], values: Sequence[torch.Tensor]
) -> List[ReadoutEntry]:
    """One ReadoutEntry per site: the residual a readout patch leaves behind, and where the recomputation
    resumes. Head patches change the attention's output map by (z'_h - z_h) W_O[h] (linear), all heads of
    a layer in one product, before the block's own output step."""
    L = model.cfg.n_layers
    acts = tcap.at_readout

    def resid_pre(l: int) -> torch.Tensor:
        return acts[resid_entering(l, L)]

    out: List[Optional[ReadoutEntry]] = [None] * len(sites)
    heads_by_layer: Dict[int, List[int]] = {}
    for i, (site, v) in enumerate(zip(sites, values)):
        if site.kind == "embed":
            out[i] = ReadoutEntry(0, PRE, v)
        elif site.kind == "resid":
            out[i] = ReadoutEntry(site.layer, PRE, v)
        elif site.kind == "attn":
            out[i] = ReadoutEntry(site.layer, MID, resid_pre(site.layer) + v)
        elif site.kind == "mlp":
            out[i] = ReadoutEntry(site.layer + 1, PRE, acts[act_name("resid_mid", site.layer)] + v)
        else:
            heads_by_layer.setdefault(site.layer, []).append(i)
    for l, members in heads_by_layer.items():
        new = torch.stack([values[i] for i in members], 1)  # [B, k, d_head]
        heads = [sites[i].head for i in members]
        state = model.resid_mid_with_heads(l, resid_pre(l), acts[act_name("z", l)], heads, new)
        for j, i in enumerate(members):
            out[i] = ReadoutEntry(l, MID, state[:, j])
    return out


def readout_sweep(
    model,
    tcap: Capture,
    entries: Sequence[ReadoutEntry],
    *,
    context=None,
    layer_changes: bool = False,
):
    """Final residuals [B, P, d] at the readout of every entry, recomputing only the readout token
    (`layer_changes`: also each block's change of every row, [B, P, L, d]). `context`: the target's
    readout context, when the caller built it already."""
    ctx = context if context is not None else model.readout_context(tcap.tok, kv=tcap.full)
    return model.readout_sweep(ctx, entries, layer_changes=layer_changes)


def start_layer(site: Site) -> int:
    return -1 if site.kind == "embed" else site.layer  # -1: a full forward (hook_embed may precede positions)


def full_resid_names(model, sites: Sequence[Site]) -> List[str]:
    """The residuals the layer engine restarts from (kept whole in the target's clean run)."""
    L = model.cfg.n_layers
    return sorted({resid_entering(start_layer(s), L) for s in sites if s.kind != "embed"})


def writer(patches: List[Tuple[torch.Tensor, torch.Tensor, Optional[int], torch.Tensor]]) -> Callable:
    """A hook writing each (rows, positions, head, values) patch into the activation."""

    def hook(x: torch.Tensor, hook) -> torch.Tensor:
        x = x.clone()
        for rows, pos, head, values in patches:
            if head is None:
                x[rows, pos] = values.to(x.dtype)
            else:
                x[rows, pos, head] = values.to(x.dtype)
        return x

    return hook


def start_at_layer_sweep(model, tcap: Capture, sites, pos: Positions, values, max_rows: int) -> torch.Tensor:
    """Multi-position patches: rerun from the patched layer on the cached clean residual, many sites per
    forward (site p occupies rows p*B .. p*B+B-1)."""
    L = model.cfg.n_layers
    tok = tcap.tok
    B = tok.input_ids.shape[0]
    device = tok.input_ids.device
    out = torch.empty(B, len(sites), device=device, dtype=torch.float32)
    rows, t_pos = pos.t_rows.to(device), pos.t_pos.to(device)
    by_layer: Dict[int, List[int]] = {}
    for i, s in enumerate(sites):
        by_layer.setdefault(start_layer(s), []).append(i)
    per_call = max(1, max_rows // B)
    for layer, members in sorted(by_layer.items()):
        for c in range(0, len(members), per_call):
            chunk = members[c : c + per_call]
            k = len(chunk)
            ids = tok.input_ids.repeat(k, 1)
            x = ids if layer < 0 else tcap.full[resid_entering(layer, L)].repeat(k, 1, 1)
            hooks: Dict[str, list] = {}
            for j, i in enumerate(chunk):
                site = sites[i]
                r = rows + j * B
                if site.kind == "resid":
                    x[r, t_pos] = values[i].to(x.dtype)
                else:
                    hooks.setdefault(site.hook_name(L), []).append((r, t_pos, site.head, values[i]))
            rewards = model.run_with_hooks(
                x,
                tok.attention_mask.repeat(k, 1),
                start_at_layer=None if layer < 0 else layer,
                input_ids=ids,
                readout_positions=tok.readout.repeat(k),
                fwd_hooks=[(h, writer(p)) for h, p in hooks.items()],
            )
            out[:, chunk] = rewards.float().view(k, B).T
    return out


def naive_sweep(model, tok: Tokenized, sites, pos: Positions, values) -> torch.Tensor:
    """One full forward per site with `run_with_hooks` writing the patch: the reference."""
    L = model.cfg.n_layers
    device = tok.input_ids.device
    rows, t_pos = pos.t_rows.to(device), pos.t_pos.to(device)
    out = []
    for site, v in zip(sites, values):
        hook = writer([(rows, t_pos, site.head, v)])
        out.append(
            model.run_with_hooks(
                tok.input_ids,
                tok.attention_mask,
                readout_positions=tok.readout,
                fwd_hooks=[(site.hook_name(L), hook)],
            ).float()
        )
    return torch.stack(out, -1)


def clean_reads(
    model, batch: PairBatch, sites, modes, positions: str, method: str
) -> Tuple[Dict[str, Tuple[List[str], List[str]]], Dict[str, str]]:
    """(side -> (names kept at the readout, names kept whole)) the engines and the sources need from the
    clean runs, and the engine of each target."""
    L = model.cfg.n_layers
    targets = {t for m in modes for t in TARGETS[m]}
    sources = {SOURCE[m] for m in modes if m in SOURCE}
    site_hooks = sorted({s.hook_name(L) for s in sites})
    reads: Dict[str, Tuple[List[str], List[str]]] = {}
    engine_for: Dict[str, str] = {}
    for side, tok in (("chosen", batch.chosen), ("rejected", batch.rejected)):
        readout_names, full_names = [], []
        if side in targets:
            fast = positions == "readout" and readout_recompute_exact(model, tok)
            engine_for[side] = "naive" if method == "naive" else "readout" if fast else "layer"
            if engine_for[side] == "readout":
                at_readout, whole = readout_capture_names(model, sites)
                readout_names += at_readout
                full_names += whole
            elif engine_for[side] == "layer":
                full_names += full_resid_names(model, sites)
        if side in sources:
            (readout_names if positions == "readout" else full_names).extend(site_hooks)
        reads[side] = (readout_names, full_names)
    return reads, engine_for


def clean_captures(
    model, batch: PairBatch, sites, modes, positions: str, method: str
) -> Tuple[Dict[str, Capture], Dict[str, str]]:
    """One clean run per side keeping what the engines and the sources need; the engine of each target."""
    reads, engine_for = clean_reads(model, batch, sites, modes, positions, method)
    caps = {side: capture(model, getattr(batch, side), *reads[side]) for side in ("chosen", "rejected")}
    return caps, engine_for


@dataclass
class SweepOut:
    """One readout sweep of a (mode, target): each site's entry, the final residuals [batch, n_sites,
    d_model], the patched rewards [batch, n_sites] and, when asked, each block's change of every row
    [batch, n_sites, n_layers, d_model] (`model.readout_sweep(..., layer_changes=True)`)."""

    entries: List[ReadoutEntry]
    final: torch.Tensor
    patched: torch.Tensor
    changes: Optional[torch.Tensor] = None


@dataclass
class SweepMemo:
    """The readout sweeps of one batch, shared by every instrument stepping on it (a pipeline `Shared`
    holds one): (mode, target, site names, mean values' id) -> SweepOut, each target's readout context,
    and the (mode, target) keys whose per-block changes an instrument of this pass asked for."""

    sweeps: Dict[tuple, SweepOut] = field(default_factory=dict)
    contexts: Dict[str, object] = field(default_factory=dict)
    want_changes: set = field(default_factory=set)

    @staticmethod
    def key(mode: str, target: str, sites, means) -> tuple:
        return mode, target, tuple(s.name for s in sites), id(means) if mode == "mean" else None


def sweep_memo(shared) -> SweepMemo:
    """The readout sweeps a pipeline batch (`Shared`) holds for its instruments."""
    return shared.memo.setdefault("readout_sweeps", SweepMemo())


def _readout_jobs(model, tcap: Capture, target: str, sites, jobs, means, memo: SweepMemo, direction) -> None:
    """Fill memo.sweeps for every (mode, values) job of one target not there yet: their entries in ONE
    readout sweep (the modes of a target share the block steps and their matmuls)."""
    todo = []
    for mode, values in jobs:
        key = SweepMemo.key(mode, target, sites, means)
        have = memo.sweeps.get(key)
        wanted = (mode, target) in memo.want_changes
        if have is None or (wanted and have.changes is None):
            todo.append((key, readout_entries(model, tcap, sites, values)))
    if not todo:
        return
    if target not in memo.contexts:
        memo.contexts[target] = model.readout_context(tcap.tok, kv=tcap.full)
    changes = any(key[:2] in memo.want_changes for key, _ in todo)
    entries = [e for _, es in todo for e in es]
    got = readout_sweep(model, tcap, entries, context=memo.contexts[target], layer_changes=changes)
    final, deltas = got if changes else (got, None)
    d, b = direction
    rewards = reward_from_final_resid(model, final, d[:, None], b[:, None])
    n = len(sites)
    for j, (key, es) in enumerate(todo):
        cut = slice(j * n, (j + 1) * n)
        memo.sweeps[key] = SweepOut(
            es, final[:, cut], rewards[:, cut], None if deltas is None else deltas[:, cut]
        )


def patch_batch(
    model,
    batch: PairBatch,
    sites,
    modes,
    positions,
    method,
    means,
    pair_ids,
    max_rows,
    caps: Optional[Dict[str, Capture]] = None,
    directions: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None,
    memo: Optional[SweepMemo] = None,
) -> BatchPatches:
    """Every mode's patches of one batch of pairs, each target on its engine. `caps`: clean captures of
    both sides already holding what `clean_reads` names (a shared pipeline pass); else they are run here.
    `directions`: side -> readout direction, filled and reused (ArmoRM's gate costs a forward). `memo`: the
    batch's readout sweeps, reused where another instrument already ran the same (mode, target, sites)
    and filled for the next one (a pipeline passes `Shared.memo`); each target's modes run as one sweep."""
    if caps is None:
        caps, engine_for = clean_captures(model, batch, sites, modes, positions, method)
    else:
        engine_for = clean_reads(model, batch, sites, modes, positions, method)[1]
    out = BatchPatches({}, caps["chosen"].rewards.float(), caps["rejected"].rewards.float(), caps)
    directions = {} if directions is None else directions
    memo = SweepMemo() if memo is None else memo
    readout_jobs: Dict[str, list] = {}
    for mode in modes:
        src = caps[SOURCE[mode]] if mode in SOURCE else None
        for target in TARGETS[mode]:
            tcap = caps[target]
            pos = patch_positions(batch, positions, tcap.tok, src.tok if src else None, pair_ids)
            values = [site_values(model, s, mode, pos, src, means, positions) for s in sites]
            key = (mode, target)
            if engine_for[target] == "naive":
                out.patched[key] = naive_sweep(model, tcap.tok, sites, pos, values)
            elif engine_for[target] == "readout":
                readout_jobs.setdefault(target, []).append((mode, values))
            else:
                out.patched[key] = start_at_layer_sweep(model, tcap, sites, pos, values, max_rows)
    for target, jobs in readout_jobs.items():
        if target not in directions:  # (ArmoRM: one forward for the gate; shared by the modes)
            directions[target] = readout_direction(model, caps[target].tok)
        _readout_jobs(model, caps[target], target, sites, jobs, means, memo, directions[target])
        for mode, _ in jobs:
            got = memo.sweeps[SweepMemo.key(mode, target, sites, means)]
            key = (mode, target)
            out.patched[key], out.entries[key], out.final[key] = got.patched, got.entries, got.final
            if got.changes is not None and key in memo.want_changes:
                out.changes[key] = got.changes
    return out
