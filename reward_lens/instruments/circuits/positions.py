"""The graph of a token-aligned pair at every position (docs/theory.md, "Edge attribution" and "Circuits",
positions="all"): the same nodes as the readout graph (`graph.py`), each sender's difference taken at every
position and every receiver's input shifted at every position, every position recomputed from the
receiver's layer on (Wang et al.'s path patching; TransformerLens's `get_act_patch_direct_path` sums a
sender's write at every position too).

`full_adjoints`: input gradients of the reward at every receiver and position, where every residual of
the target run is moved by `offsets[name]` [B, P, T, d] (straight-through: the offset value, gradients
through each component's own Jacobian, as `graph.interpolated_adjoints` does at the readout).
`circuit_rewards_all`: the reward when every edge carries, at every position, either its sender's output
as recomputed in this run or the source run's output.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from reward_lens.core.batching import Tokenized
from reward_lens.core.directions import reward_from_final_resid
from reward_lens.core.readout import Capture, capture
from reward_lens.instruments.circuits.graph import (
    capture_names,
    edge_mask,
    mixed_inputs,
    receiver_columns,
    sender_deltas,
)
from reward_lens.instruments.patching.engines import readout_recompute_exact
from reward_lens.instruments.patching.path import PathNode
from reward_lens.model.frozen import gradients_on
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.sequence import SequenceContext


def target_run_all(model, tok: Tokenized, capture_target: bool = True):
    """(capture with every edge quantity kept whole, the batch's `SequenceContext`); the context alone
    with `capture_target=False`."""
    if not readout_recompute_exact(model, tok):
        raise ValueError(
            "circuits at every position need a native architecture whose head reads only the readout "
            "(not ArmoRM's gate, not the generic path)"
        )
    if not capture_target:
        return model.sequence_context(tok)
    return capture(model, tok, full_names=capture_names(model)), model.sequence_context(tok)


def source_run_all(model, tok: Tokenized) -> Capture:
    return capture(model, tok, full_names=capture_names(model))


def residual_names(model) -> List[str]:
    L = model.cfg.n_layers
    return [act_name(k, l) for l in range(L) for k in ("resid_pre", "resid_mid")] + [final_resid_name(L)]


def joint_offsets_all(model, tgt, src, alphas: torch.Tensor) -> Dict[str, torch.Tensor]:
    """alpha * (source - target) [B, P, T, d] of every residual at every position (all senders together)."""
    names = residual_names(model)
    a = alphas.float().to(tgt[names[0]].device)[None, :, None, None]
    return {n: a * (src[n] - tgt[n]).float()[:, None] for n in names}


def sender_offsets_all(model, senders: Sequence[PathNode], deltas: torch.Tensor, alphas: torch.Tensor):
    """Offsets [B, S * P, T, d]: row (s, k) moves only sender s, by alphas[k] * Δ_s at every position, in
    every residual it writes (each sender's own straight line)."""
    L = model.cfg.n_layers
    B, S, T, d = deltas.shape
    P = alphas.numel()
    a = alphas.float().to(deltas.device)
    line = (a[None, None, :, None, None] * deltas[:, :, None]).reshape(B, S * P, T, d)
    out = {}
    for l in range(L):
        for kind, reader in (("resid_pre", PathNode("", "q", l, 0)), ("resid_mid", PathNode("", "mlp", l))):
            writes = torch.tensor([s.writes_before(reader) for s in senders], device=deltas.device)
            out[act_name(kind, l)] = line * writes.repeat_interleave(P)[None, :, None, None].float()
    out[final_resid_name(L)] = line
    return out


def full_adjoints(
    model,
    seq: SequenceContext,
    tgt: Dict[str, torch.Tensor],
    offsets: Dict[str, torch.Tensor],
    receivers: Sequence[PathNode],
    direction,
    bias,
    start: int = 0,
    mean_over: int = 1,
) -> torch.Tensor:
    """Gradients [B, P / mean_over, n_receivers, T, d] (means over consecutive groups of `mean_over`
    points) of the reward with respect to each receiver's own input at every position (a head's q/k/v
    input before ln1, an MLP's input, the final residual), at P points: every residual of the target run
    plus `offsets[name]` [B, P, T, d], straight-through (module docstring). Blocks before `start` are not
    run (receivers there get zero gradients)."""
    cfg, L = model.cfg, model.cfg.n_layers
    final_name = final_resid_name(L)
    B, P, T, d = offsets[final_name].shape
    rows = seq.repeat(P)

    def through(stream, name):  # the offset value, gradients into what was summed so far
        v = (tgt[name][:, None].float() + offsets[name]).reshape(B * P, T, d).to(cfg.dtype)
        return v if stream is None else stream + (v - stream).detach()

    def leaf(*shape):
        return torch.zeros(
            B * P, T, *shape, dtype=cfg.dtype, device=rows.input_ids.device, requires_grad=True
        )

    layers = {r.layer for r in receivers if r.kind != "readout"}
    leaves: Dict[tuple, torch.Tensor] = {}
    with gradients_on("edge_attribution"):
        stream = None
        for l in range(start, L):
            block = model.blocks[l]
            cos, sin, allowed = rows.step_args(block, rows.input_ids.device)
            x = through(stream, act_name("resid_pre", l))
            inputs = [None, None, None]
            if l in layers:
                for i, (kind, n) in enumerate(
                    (("q", cfg.n_heads), ("k", cfg.n_key_value_heads), ("v", cfg.n_key_value_heads))
                ):
                    leaves[(kind, l)] = leaf(n, d)
                    inputs[i] = x[:, :, None] + leaves[(kind, l)]
            z = block.z_with_inputs(x, cos, sin, allowed, *inputs)
            attn = block.attn_out_from_z(z)
            mid = through(x + attn, act_name("resid_mid", l))
            leaves[("mlp", l)] = leaf(d) if l in layers else None
            stream = block.readout_mlp(mid, leaves[("mlp", l)])
        leaves[("readout", None)] = leaf(d)
        final = through(stream, final_name) + leaves[("readout", None)]
        at = final[torch.arange(B * P, device=final.device), rows.readout]
        reward = reward_from_final_resid(
            model, at, direction.repeat_interleave(P, 0), bias.repeat_interleave(P, 0)
        )
        wanted = {k: v for k, v in leaves.items() if v is not None}
        grads = dict(zip(wanted, torch.autograd.grad(reward.sum(), list(wanted.values()), allow_unused=True)))
    cols = []
    for r in receivers:
        g = grads.get((r.kind, r.layer))
        if g is None:
            g = torch.zeros(B * P, T, d, device=final.device)
        elif r.kind in ("q", "k", "v"):
            g = g[:, :, r.index]
        cols.append(g.float().view(B, P // mean_over, mean_over, T, d).mean(2))
    return torch.stack(cols, 2)


@torch.no_grad()
def circuit_rewards_all(
    model,
    tgt: Dict[str, torch.Tensor],
    seq: SequenceContext,
    src: Dict[str, torch.Tensor],
    senders: Sequence[PathNode],
    receivers: Sequence[PathNode],
    recomputed: torch.Tensor,
    direction,
    bias,
) -> torch.Tensor:
    """Rewards [B, K] of K edge assignments `recomputed` [K, n_senders, n_receivers] (bool) at every position:
    True, the edge carries its sender's output as recomputed in this run; False, the source run's output
    (`graph.circuit_rewards` at every position). Needs the default senders and receivers."""
    cfg, L = model.cfg, model.cfg.n_layers
    delta = sender_deltas(model, senders, tgt, src).to(cfg.dtype)
    valid = edge_mask(senders, receivers).to(delta.device)
    recomputed = recomputed.to(delta.device)
    B, S, T, d = delta.shape
    K = recomputed.shape[0]
    rows = seq.repeat(K)
    circ = torch.zeros(B, K, S, T, d, dtype=cfg.dtype, device=delta.device)
    by_kind = receiver_columns(cfg, receivers)
    sender_at = {(s.kind, s.layer, s.index): i for i, s in enumerate(senders)}
    for l in range(L):
        block = model.blocks[l]
        xs = []
        for kind in ("q", "k", "v"):
            cols = by_kind[(kind, l)]
            x = mixed_inputs(tgt[act_name("resid_pre", l)], circ, delta, recomputed, valid, cols)
            xs.append(x.permute(0, 1, 3, 2, 4).reshape(B * K, T, len(cols), d))  # [B*K, T, heads, d]
        base = tgt[act_name("resid_pre", l)].repeat_interleave(K, 0)
        z = block.z_with_inputs(base, *rows.step_args(block, base.device), *xs).view(B, K, T, cfg.n_heads, -1)
        z_t = tgt[act_name("z", l)][:, None]
        heads = torch.einsum("bkthe,hem->bkhtm", z - z_t, block.attn.W_O.to(z.dtype))
        for h in range(cfg.n_heads):
            if ("head", l, h) in sender_at:
                circ[:, :, sender_at[("head", l, h)]] = heads[:, :, h]
        if ("attn", l, None) in sender_at:
            circ[:, :, sender_at[("attn", l, None)]] = (
                block.attn_out_from_z(z) - tgt[act_name("attn_out", l)][:, None]
            )
        x = mixed_inputs(tgt[act_name("resid_mid", l)], circ, delta, recomputed, valid, by_kind[("mlp", l)])
        mlp_d = block.mlp_post(block.mlp(block.ln2(x[:, :, 0]))) - tgt[act_name("mlp_out", l)][:, None]
        if ("mlp", l, None) in sender_at:
            circ[:, :, sender_at[("mlp", l, None)]] = mlp_d
    final = mixed_inputs(tgt[final_resid_name(L)], circ, delta, recomputed, valid, by_kind[("readout", None)])
    at = final[:, :, 0][torch.arange(B, device=final.device), :, seq.readout]  # [B, K, d]
    return reward_from_final_resid(model, at, direction[:, None], bias[:, None]).float()
