"""The attribution graph's arithmetic: one text, the model linearised at it, direct effects between
(component, position) nodes.

The linearisation freezes, at their clean values on the text, every attention pattern, every norm's scale
(ln1, ln2, the final norm) and each gated MLP's gate activation act(x W_gate), as circuit-tracer freezes
attention patterns and norms (and its transcoders' nonlinearities). What is left is affine in the token
embeddings: each head's output is sum_q A[p, q] (x_q * gain1 / scale1_q) W_V W_O (+ its value bias), each
MLP's is ((x_p * gain2 / scale2_p) W_in + b_in) * act_gate_p) W_out (+ b_out), the reward is
direction . x_final[readout] / scale_f + bias. One backward pass of the reward through that frozen model
gives the gradient G at every residual slot; a node's value is G . (what it writes), its exact total effect
on the reward; an edge is the direct effect of a source's write on a target through the target's frozen
input map. Nothing here runs attention or positions itself: the patterns come from the model's hooks.

Sources live in slots [position, slot]: slot 0 the token embedding (the residual entering block 0), then per
layer its heads, the attention output bias (only where a layer has one) and its MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional

import torch

from reward_lens.core.batching import Tokenized
from reward_lens.core.directions import readout_direction
from reward_lens.model.frozen import gradients_on
from reward_lens.model.hooks import act_name, final_resid_name

EMBED, HEAD, BIAS, MLP = "embed", "head", "bias", "mlp"


@dataclass
class SlotLayout:
    """Which component each of the K slots of one position is: kind, layer, head, and the level it writes
    at (a target at layer l reads the slots with a lower level: heads read levels < l, MLPs < l + 0.5)."""

    kind: List[str]
    layer: List[int]
    head: List[int]
    level: torch.Tensor  # [K] float

    @classmethod
    def of(cls, n_layers: int, n_heads: int, attn_bias: bool) -> "SlotLayout":
        kind, layer, head, level = [EMBED], [-1], [-1], [-1.0]
        for l in range(n_layers):
            for h in range(n_heads):
                kind, layer, head, level = kind + [HEAD], layer + [l], head + [h], level + [l + 0.25]
            if attn_bias:
                kind, layer, head, level = kind + [BIAS], layer + [l], head + [-1], level + [l + 0.25]
            kind, layer, head, level = kind + [MLP], layer + [l], head + [-1], level + [l + 0.75]
        return cls(kind, layer, head, torch.tensor(level))

    def head_slot(self, layer: int, head: int) -> int:
        return self.index[(HEAD, layer, head)]

    def mlp_slot(self, layer: int) -> int:
        return self.index[(MLP, layer, -1)]

    @property
    def index(self) -> Dict[tuple, int]:
        return {(k, l, h): i for i, (k, l, h) in enumerate(zip(self.kind, self.layer, self.head))}


@dataclass
class Linearised:
    """The frozen model at one text (float32, batch axis dropped): what every slot writes (`out`, [T, K,
    d_model]), the reward's gradient at the residual it writes into (`grad`, same shape), the frozen input
    maps (patterns [L, H, T, T], gain / scale of ln1 and ln2 [L, T, d_model], gate activations [L, T,
    d_mlp]) and the readout (direction / scale_f [d_model], position, reward, bias)."""

    layout: SlotLayout
    out: torch.Tensor
    grad: torch.Tensor
    patterns: torch.Tensor
    gain1: torch.Tensor
    gain2: torch.Tensor
    gate: torch.Tensor
    readout_map: torch.Tensor
    readout: int
    reward: float
    bias: float

    @cached_property
    def values(self) -> torch.Tensor:
        """[T, K] each slot's exact total effect on the reward in the linearised model, G . out."""
        return (self.out * self.grad).sum(-1)


def check_supported(model) -> None:
    """Refuse, in one line, models the frozen-nonlinearity linearisation does not cover."""
    from reward_lens.model.components import GatedMLP, RMSNorm
    from reward_lens.model.native import NativeRewardModel

    if not isinstance(model, NativeRewardModel):
        raise ValueError(
            "attribution_graph needs a natively hooked model (HookedRewardModel), not "
            f"{type(model).__name__}; load it with HookedRewardModel.from_pretrained (the generic "
            "transformers path has no hooks inside attention and MLPs)"
        )
    cfg = model.cfg
    if cfg.post_norms:
        raise ValueError(
            "attribution_graph covers pre-norm blocks (Llama, Qwen, Mistral, Gemma-1 families); this model "
            "has post-norms (Gemma-2), whose outputs pass a norm after their maps"
        )
    blocks = list(model.blocks)
    if not all(isinstance(b.mlp, GatedMLP) and isinstance(b.ln1, RMSNorm) for b in blocks):
        raise ValueError("attribution_graph covers gated MLPs behind RMSNorms (the Llama family) only")


def _hooks(model, caps: Dict[str, torch.Tensor]) -> list:
    """Forward hooks: freeze (detach) the patterns, norm scales and gate pre-activations, keeping them; keep
    the residuals (in the autograd graph, for their gradients), the heads' z and the MLPs' outputs."""

    def freeze(t, hook):
        caps[hook.name] = t.detach()
        return caps[hook.name]

    def keep(t, hook):
        caps[hook.name] = t

    def leaf(t, hook):
        caps[hook.name] = t.detach().requires_grad_(True)
        return caps[hook.name]

    L = model.cfg.n_layers
    out = [(act_name("embed"), leaf), (act_name("scale"), freeze)]
    for l in range(L):
        out += [
            (act_name("pattern", l), freeze),
            (act_name("scale", l, norm="ln1"), freeze),
            (act_name("scale", l, norm="ln2"), freeze),
            (act_name("pre", l), freeze),
            (act_name("resid_pre", l), keep),
            (act_name("resid_mid", l), keep),
            (act_name("resid_post", l), keep),
            (act_name("z", l), keep),
            (act_name("mlp_out", l), keep),
        ]
    return out


def linearise(model, tok: Tokenized) -> Linearised:
    """One hooked forward (patterns, scales, gates frozen) and one backward of the reward through it."""
    cfg = model.cfg
    L, H, T = cfg.n_layers, cfg.n_heads, tok.input_ids.shape[1]
    direction, bias = readout_direction(model, tok)
    readout = int(tok.readout[0])
    caps: Dict[str, torch.Tensor] = {}
    with gradients_on("attribution_graph"):
        model.run_with_hooks(
            tok.input_ids, tok.attention_mask, return_type=None, fwd_hooks=_hooks(model, caps)
        )
        scale_f = caps[act_name("scale")][0, readout].float()
        readout_map = direction[0].float().to(scale_f.device) / scale_f
        final = caps[final_resid_name(L)][0, readout].float()
        reward = (final * readout_map).sum() + bias[0].float()
        slots = [act_name("resid_pre", 0)] + [
            act_name(k, l) for l in range(L) for k in ("resid_mid", "resid_post")
        ]
        grads = torch.autograd.grad(reward, [caps[n] for n in slots], allow_unused=True)
    grad = {n: (torch.zeros(T, cfg.d_model) if g is None else g[0].float()) for n, g in zip(slots, grads)}
    attn_bias = any(bool(b.attn.b_O.detach().abs().max() > 0) for b in model.blocks)
    layout = SlotLayout.of(L, H, attn_bias)
    outs, gs = [caps[act_name("resid_pre", 0)].detach()[0].float()], [grad[slots[0]]]
    for l, block in enumerate(model.blocks):
        z = caps[act_name("z", l)].detach()[0].float()  # [T, H, d_head]
        W_O = block.attn.W_O.detach().float().to(z.device)
        heads = torch.einsum("thd,hdm->thm", z, W_O)
        mid, post = grad[act_name("resid_mid", l)], grad[act_name("resid_post", l)]
        outs += [heads[:, h] for h in range(H)]
        gs += [mid] * H
        if attn_bias:
            outs.append(block.attn.b_O.detach().float().to(z.device).expand(T, -1))
            gs.append(mid)
        outs.append(caps[act_name("mlp_out", l)].detach()[0].float())
        gs.append(post)
    cpu = torch.device("cpu")  # the rows are built on the CPU, whatever device the model runs on
    return Linearised(
        layout=layout,
        out=torch.stack([o.to(cpu) for o in outs], 1),
        grad=torch.stack([g.to(cpu) for g in gs], 1),
        patterns=torch.stack([caps[act_name("pattern", l)][0].float() for l in range(L)]),
        gain1=_gains(model, caps, "ln1"),
        gain2=_gains(model, caps, "ln2"),
        gate=torch.stack(
            [b.mlp.act(caps[act_name("pre", l)][0]).float() for l, b in enumerate(model.blocks)]
        ),
        readout_map=readout_map.detach(),
        readout=readout,
        reward=float(reward.detach()),
        bias=float(bias[0]),
    )


def _gains(model, caps, norm: str) -> torch.Tensor:
    """[L, T, d_model] the frozen norm as a per-position linear map, gain / scale (`RMSNorm.frozen_gain`)."""
    out = []
    for l, block in enumerate(model.blocks):
        scale = caps[act_name("scale", l, norm=norm)][0]
        scale = scale.reshape(scale.shape[0], -1)[:, :1]  # split q/k/v inputs: one scale per head, all equal
        out.append(getattr(block, norm).frozen_gain(scale).to(caps[act_name("scale")].device))
    return torch.stack(out)


def row_of(kind: str, layer: int, n_layers: int) -> float:
    """The y row of a node: embed 0, layer l's heads 1 + 2l, its MLP 2 + 2l, the reward at the top."""
    if kind == "embed":
        return 0.0
    if kind == "reward":
        return 1.0 + 2 * n_layers
    return 2.0 + 2 * layer if kind == "mlp" else 1.0 + 2 * layer


# ---------------------------------------------------------------------------------------------------
# Edge rows: the direct effect of every source slot on one target, [T, K] per target.


def head_rows(model, lin: Linearised, targets: List[tuple], chunk: int = 32) -> torch.Tensor:
    """[n, T, K] rows of head targets (layer, head, position): w(s@q -> t) = A[p, q] (out_s[q] * gain1_q)
    . W_V[g] W_O[h] G_mid[p], for the slots of lower level; 0 elsewhere."""
    cfg = model.cfg
    group = cfg.n_heads // cfg.n_key_value_heads
    T, K, _ = lin.out.shape
    rows = torch.zeros(len(targets), T, K)
    layers = torch.tensor([t[0] for t in targets], dtype=torch.long)
    for layer in sorted(set(layers.tolist())):
        attn = model.blocks[layer].attn
        keep = lin.layout.level < layer
        sources = lin.out[:, keep]  # [T, k, d_model]
        for idx in torch.nonzero(layers == layer).flatten().split(chunk):
            h = torch.tensor([targets[i][1] for i in idx.tolist()])
            p = torch.tensor([targets[i][2] for i in idx.tolist()])
            g_mid = lin.grad[p, lin.layout.head_slot(layer, 0)]  # [n, d_model], resid_mid's gradient
            W_O = attn.W_O.detach().float()[h].to(g_mid.device)  # [n, d_head, d_model]
            W_V = attn.W_V.detach().float()[h // group].to(g_mid.device)  # [n, d_model, d_head]
            u = torch.einsum("nmd,nd->nm", W_V, torch.einsum("nhd,nd->nh", W_O, g_mid))
            A = lin.patterns[layer][h, p]  # [n, T] the pattern row of each target
            M = A[:, :, None] * lin.gain1[layer][None] * u[:, None, :]  # [n, T, d_model]
            full = torch.zeros(len(idx), T, K)
            full[:, :, keep] = torch.einsum("nqd,qkd->nqk", M, sources)
            rows[idx] = full
    return rows


def mlp_rows(model, lin: Linearised, targets: List[tuple]) -> torch.Tensor:
    """[n, K] rows of MLP targets (layer, position), the sources at the same position: w(s@p -> t) =
    (out_s[p] * gain2_p) . W_in (gate_p * (W_out G_post[p])), for the slots of lower level."""
    T, K, _ = lin.out.shape
    rows = torch.zeros(len(targets), K)
    for i, (layer, p) in enumerate(targets):
        mlp = lin.layout.mlp_slot(layer)
        g_post = lin.grad[p, mlp]
        W_in, W_out = (
            w.detach().float().to(g_post.device)
            for w in (model.blocks[layer].mlp.W_in, model.blocks[layer].mlp.W_out)
        )
        u = W_in @ (lin.gate[layer, p] * (W_out @ g_post)) * lin.gain2[layer, p]
        keep = lin.layout.level < layer + 0.5
        rows[i, keep] = lin.out[p, keep] @ u
    return rows


def reward_row(lin: Linearised) -> torch.Tensor:
    """[K] the reward's incoming edges, the exact attribution of the readout: direction / scale_f . out_s."""
    return lin.out[lin.readout] @ lin.readout_map


def own_bias_terms(model, lin: Linearised, heads: List[tuple], mlps: List[tuple]) -> Dict[tuple, float]:
    """Each target's own constant (its value bias, b_in and b_out) along G: what its error node holds
    where the linearisation is exact, an independent account of the remainder."""
    cfg = model.cfg
    group = cfg.n_heads // cfg.n_key_value_heads
    out: Dict[tuple, float] = {}
    for layer, h, p in heads:
        attn = model.blocks[layer].attn
        g = lin.grad[p, lin.layout.head_slot(layer, h)]
        mass = lin.patterns[layer][h, p].sum()
        bv = attn.b_V.detach().float()[h // group] @ attn.W_O.detach().float()[h]
        out[(HEAD, layer, h, p)] = float(mass * (bv.to(g.device) @ g))
    for layer, p in mlps:
        mlp = model.blocks[layer].mlp
        g = lin.grad[p, lin.layout.mlp_slot(layer)]
        const = (
            lin.gate[layer, p] * mlp.b_in.detach().float()
        ) @ mlp.W_out.detach().float() + mlp.b_out.detach().float()
        out[(MLP, layer, p)] = float(const.to(g.device) @ g)
    return out


def candidate_targets(lin: Linearised, max_nodes: Optional[int]) -> List[tuple]:
    """The heads and MLPs whose incoming edges are materialised: the `max_nodes` largest |value| (all when
    None), as (kind, layer, head, position)."""
    T, K = lin.values.shape
    component = torch.tensor([k in (HEAD, MLP) for k in lin.layout.kind])
    score = torch.where(component[None], lin.values.abs(), torch.full((T, K), -1.0)).flatten()
    n = int(component.sum()) * T if max_nodes is None else min(max_nodes, int(component.sum()) * T)
    order = torch.sort(score, descending=True, stable=True).indices[:n].tolist()
    lay = lin.layout
    return [(lay.kind[i % K], lay.layer[i % K], lay.head[i % K], i // K) for i in order]
