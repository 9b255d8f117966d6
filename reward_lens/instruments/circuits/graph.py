"""The readout graph of a contrastive pair: nodes that partition the residual at the readout, their edges,
and two recomputations of the readout token over the target run's cached keys/values (docs/theory.md,
"Edge attribution" and "Circuits").

Senders: "embed" (the residual entering block 0) and path patching's senders (`L{l}H{h}`, `attn_L{l}`,
`mlp_L{l}`); the default set, embed + every head + every MLP, partitions the readout residual's difference
between the two runs (attention biases are the same in both). Receivers: path patching's (`L{l}H{h}.q`,
`L{l}KV{g}.k`, `L{l}KV{g}.v`, `mlp_L{l}`, `readout`). Every quantity is at the readout position; the other
positions keep the target run's keys and values, exactly as `path_patch` defines a path.

`interpolated_adjoints`: one batched pass over `steps` points alpha on the straight line between the target
and source readout activations; every receiver reads (1 - alpha) * target + alpha * source and its input
gradient (through that receiver alone, downstream recomputed) comes back from one backward.
`circuit_rewards`: the reward when every edge carries either the recomputed value of its sender (in this
run) or the source run's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from reward_lens.core.batching import Tokenized
from reward_lens.core.directions import reward_from_final_resid
from reward_lens.core.readout import Capture, capture
from reward_lens.instruments.patching.engines import readout_recompute_exact
from reward_lens.instruments.patching.path import (
    PathNode,
    default_receivers,
    parse_receiver,
    parse_sender,
    sender_delta,
)
from reward_lens.model.frozen import gradients_on, with_frozen_weights
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.recompute import ReadoutContext

EMBED = PathNode("embed", "embed", -1)
TARGET = {"noising": ("chosen", "rejected"), "denoising": ("rejected", "chosen")}  # (target, source)


def parse_node(cfg, name: str) -> PathNode:
    return EMBED if name == "embed" else parse_sender(cfg, name)


def default_senders(model) -> List[str]:
    """embed, every head, every MLP: a partition of the readout residual (attention biases cancel). With
    post-norms (Gemma-2) a layer's heads do not add up to its attention output: `attn_L{l}` there."""
    cfg = model.cfg
    out = ["embed"]
    for l in range(cfg.n_layers):
        if model.blocks[l].output_gain_hooks():
            out.append(f"attn_L{l}")
        else:
            out += [f"L{l}H{h}" for h in range(cfg.n_heads)]
        out.append(f"mlp_L{l}")
    return out


def nodes(model, senders: Optional[Sequence[str]], receivers: Optional[Sequence[str]]):
    cfg = model.cfg
    s = [parse_node(cfg, n) for n in (senders or default_senders(model))]
    r = [parse_receiver(cfg, n) for n in (receivers or default_receivers(cfg))]
    return s, r


def edge_mask(senders: Sequence[PathNode], receivers: Sequence[PathNode]) -> torch.Tensor:
    """[n_senders, n_receivers] bool: the sender writes the residual the receiver reads."""
    return torch.tensor([[s.writes_before(r) for r in receivers] for s in senders], dtype=torch.bool)


@dataclass
class TargetRun:
    """The target run's readout activations (`cap`) and the model's readout context (`readout`: positions,
    RoPE tables, visible positions and every layer's cached keys/values), as the recomputation needs them."""

    cap: Capture
    readout: ReadoutContext

    def step_args(self, layer: int):
        """(cos, sin, past_k, past_v, sees) of block `layer`'s one-token step, on the batch's device."""
        home = self.readout.home
        cos, sin, sees = self.readout.on(home)
        return (cos, sin, *self.readout.layer_kv(layer, home), sees)


def capture_names(model) -> List[str]:
    """What every edge quantity reads at the readout: residuals, component outputs, z, post-norm scales."""
    L = model.cfg.n_layers
    names = [act_name(k, l) for l in range(L) for k in ("resid_pre", "resid_mid", "attn_out", "mlp_out", "z")]
    names += [n for b in model.blocks for n in b.output_gain_hooks()]
    return names + [final_resid_name(L), act_name("final_scale")]


def target_run(model, tok: Tokenized) -> TargetRun:
    """One capture of the target run (readout activations and the keys/values the readout step attends to)
    and the model's readout context built on it."""
    if not readout_recompute_exact(model, tok):
        raise ValueError(
            "edge quantities recompute the readout alone, which needs a native architecture whose head "
            "reads nothing at or after the readout (not ArmoRM's gate, not the generic path)"
        )
    cap = capture(model, tok, capture_names(model), model.readout_kv_names())
    return TargetRun(cap, model.readout_context(tok, kv=cap.full))


def sender_deltas(model, senders: Sequence[PathNode], tgt, src) -> torch.Tensor:
    """[B, n_senders, d_model] float32: each sender's readout output, source run minus target run, from
    readout activations; [B, n_senders, T, d_model] at every position from whole-sequence ones."""
    out = []
    for s in senders:
        if s.kind == "embed":
            name = act_name("resid_pre", 0)
            out.append(src[name] - tgt[name])
        else:
            out.append(sender_delta(model, s, tgt, src))
    return torch.stack(out, 1).float()


def joint_offsets(model, tgt, src, alphas: torch.Tensor) -> Dict[str, torch.Tensor]:
    """alpha * (source - target) [B, P, d] of every residual a receiver reads: the straight line between the
    two runs' readout activations, all senders together."""
    L = model.cfg.n_layers
    names = [act_name(k, l) for l in range(L) for k in ("resid_pre", "resid_mid")] + [final_resid_name(L)]
    a = alphas.float().to(tgt[names[0]].device)[None, :, None]
    return {n: a * (src[n] - tgt[n]).float()[:, None] for n in names}


def sender_offsets(model, senders: Sequence[PathNode], deltas: torch.Tensor, alphas: torch.Tensor):
    """Offsets [B, S * P, d]: row (s, k) moves only sender s, by alphas[k] * Δ_s, in every residual it
    writes (each sender's own straight line)."""
    L = model.cfg.n_layers
    B, S, d = deltas.shape
    P = alphas.numel()
    a = alphas.float().to(deltas.device)
    line = (a[None, None, :, None] * deltas[:, :, None]).reshape(B, S * P, d)
    out = {}
    for l in range(L):
        for kind, reader in (("resid_pre", PathNode("", "q", l, 0)), ("resid_mid", PathNode("", "mlp", l))):
            writes = torch.tensor([s.writes_before(reader) for s in senders], device=deltas.device)
            out[act_name(kind, l)] = line * writes.repeat_interleave(P)[None, :, None].float()
    out[final_resid_name(L)] = line
    return out


@with_frozen_weights
def interpolated_adjoints(
    model, ctx: TargetRun, offsets: Dict[str, torch.Tensor], direction, bias, start: int = 0
) -> Dict[str, torch.Tensor]:
    """Input gradients of the reward at every receiver at P points: the readout residuals of the target run
    plus `offsets[name]` [B, P, d] (e.g. `joint_offsets`: alpha of the way to the source run).

    Every receiver's input takes that value; gradients flow through each component's own Jacobian at it
    (a straight-through sum), so the gradient at a receiver's input is the reward's derivative through that
    receiver alone, downstream recomputed. Returns "q" [B, P, L, H, d], "k"/"v" [B, P, L, G, d],
    "mlp" [B, P, L, d], "readout" [B, P, d]. `start`: the pass begins at that block (receivers of earlier
    blocks get zero gradients: callers whose offsets start there need none).
    """
    cfg, L = model.cfg, model.cfg.n_layers
    tgt = ctx.cap.at_readout

    def through(stream, name):  # the offset value, gradients into what was summed so far
        v = (tgt[name][:, None].float() + offsets[name]).to(cfg.dtype)
        return v if stream is None else stream + (v - stream).detach()

    B, P = offsets[final_resid_name(L)].shape[:2]
    H, G, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model
    dev = offsets[final_resid_name(L)].device
    zeros = {
        k: torch.zeros(B, P, L, n, d, dtype=cfg.dtype, device=dev, requires_grad=True)
        for k, n in (("q", H), ("k", G), ("v", G))
    }
    zeros["mlp"] = torch.zeros(B, P, L, d, dtype=cfg.dtype, device=dev, requires_grad=True)
    zeros["readout"] = torch.zeros(B, P, d, dtype=cfg.dtype, device=dev, requires_grad=True)
    with gradients_on("edge_attribution"):
        stream = None
        for l in range(start, L):
            block = model.blocks[l]
            x = through(stream, act_name("resid_pre", l))
            inputs = [x[:, :, None] + zeros[k][:, :, l] for k in ("q", "k", "v")]  # per head, before ln1
            stream = block.readout_attn(x, *ctx.step_args(l), *inputs)
            mid = through(stream, act_name("resid_mid", l))
            stream = mid + block.mlp_post(block.mlp(block.ln2(mid + zeros["mlp"][:, :, l])))
        final = through(stream, final_resid_name(L)) + zeros["readout"]
        reward = reward_from_final_resid(model, final, direction[:, None], bias[:, None])
        grads = torch.autograd.grad(reward.sum(), list(zeros.values()), allow_unused=True)
    return {k: (torch.zeros_like(z) if g is None else g).float() for (k, z), g in zip(zeros.items(), grads)}


def receiver_gradients(model, receivers: Sequence[PathNode], adj: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, P, n_receivers, d] picked from `interpolated_adjoints`' output."""
    cols = []
    for r in receivers:
        if r.kind == "readout":
            cols.append(adj["readout"])
        elif r.kind == "mlp":
            cols.append(adj["mlp"][:, :, r.layer])
        else:
            cols.append(adj[r.kind][:, :, r.layer, r.index])
    return torch.stack(cols, 2)


def mixed_inputs(base, circ, delta, recomputed, valid, cols):
    """base [B, ..., d] + sum over senders of the value each edge into `cols` carries, as a difference from
    the target run: circ [B, K, S, ..., d] (recomputed here), delta [B, S, ..., d] (the source's); `...` is
    empty at the readout and the position axis at every position. Returns [B, K, len(cols), ..., d]."""
    rec = (recomputed[:, :, cols] & valid[None, :, cols]).to(circ.dtype)  # [K, S, R]
    fixed = (~recomputed[:, :, cols] & valid[None, :, cols]).to(circ.dtype)
    return (
        base[:, None, None]
        + torch.einsum("bks...,ksr->bkr...", circ, rec)
        + torch.einsum("bs...,ksr->bkr...", delta, fixed)
    )


def receiver_columns(cfg, receivers: Sequence[PathNode]) -> Dict[tuple, List[int]]:
    """(kind, layer) -> the receivers' columns, each layer's q, k and v in head order. The circuit
    recomputation rebuilds whole attention blocks, so every q, k and v receiver of every layer must be
    there (else a ValueError)."""
    by_kind: Dict[tuple, List[int]] = {}
    for j, r in enumerate(receivers):
        by_kind.setdefault((r.kind, r.layer), []).append(j)
    for l in range(cfg.n_layers):
        for kind, n in (("q", cfg.n_heads), ("k", cfg.n_key_value_heads), ("v", cfg.n_key_value_heads)):
            cols = sorted(by_kind.get((kind, l), []), key=lambda j: receivers[j].index)
            if [receivers[j].index for j in cols] != list(range(n)):
                raise ValueError(
                    f"circuits need every receiver of layer {l} ({kind}); use the default receivers"
                )
            by_kind[(kind, l)] = cols
    return by_kind


@torch.no_grad()
def circuit_rewards(
    model,
    ctx: TargetRun,
    src,
    senders: Sequence[PathNode],
    receivers: Sequence[PathNode],
    recomputed: torch.Tensor,
    direction,
    bias,
) -> torch.Tensor:
    """Rewards [B, K] of K edge assignments `recomputed` [K, n_senders, n_receivers] (bool): True, the edge
    carries its sender's output as recomputed in this run; False, the source run's output. Every receiver
    reads the target residual plus, per edge, (carried value - target value); the readout token is
    recomputed over the target's cached keys/values. Needs senders that partition the residual."""
    cfg, L = model.cfg, model.cfg.n_layers
    tgt = ctx.cap.at_readout
    delta = sender_deltas(model, senders, tgt, src).to(cfg.dtype)
    valid = edge_mask(senders, receivers).to(delta.device)
    recomputed = recomputed.to(delta.device)
    B, K = delta.shape[0], recomputed.shape[0]
    circ = torch.zeros(B, K, len(senders), cfg.d_model, dtype=cfg.dtype, device=delta.device)
    by_kind = receiver_columns(cfg, receivers)
    sender_at = {(s.kind, s.layer, s.index): i for i, s in enumerate(senders)}
    for l in range(L):
        block = model.blocks[l]
        resid = tgt[act_name("resid_pre", l)]
        xs = {
            kind: block.ln1(mixed_inputs(resid, circ, delta, recomputed, valid, by_kind[(kind, l)]))
            for kind in ("q", "k", "v")
        }
        z = block.attn.forward_readout(xs["q"], *ctx.step_args(l), xs["k"], xs["v"])  # [B, K, H, d_head]
        z_t = tgt[act_name("z", l)][:, None]
        heads = torch.einsum("bkhe,hem->bkhm", z - z_t, block.attn.W_O.to(z.dtype))
        attn_d = block.attn_out_from_z(z) - tgt[act_name("attn_out", l)][:, None]
        for h in range(cfg.n_heads):
            if ("head", l, h) in sender_at:
                circ[:, :, sender_at[("head", l, h)]] = heads[:, :, h]
        if ("attn", l, None) in sender_at:
            circ[:, :, sender_at[("attn", l, None)]] = attn_d
        x = mixed_inputs(tgt[act_name("resid_mid", l)], circ, delta, recomputed, valid, by_kind[("mlp", l)])[
            :, :, 0
        ]
        mlp_d = block.mlp_post(block.mlp(block.ln2(x))) - tgt[act_name("mlp_out", l)][:, None]
        if ("mlp", l, None) in sender_at:
            circ[:, :, sender_at[("mlp", l, None)]] = mlp_d
    final = mixed_inputs(
        tgt[final_resid_name(L)], circ, delta, recomputed, valid, by_kind[("readout", None)]
    )[:, :, 0]
    return reward_from_final_resid(model, final, direction[:, None], bias[:, None]).float()
