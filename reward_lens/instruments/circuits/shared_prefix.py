"""All-position edge attribution over the columns where a token-aligned pair differs (docs/theory.md,
"Every position").

Under causal attention both runs of a token-aligned batch are equal at every column before the first one
where any row's tokens differ: every sender's difference Δ_S is zero there, so the all-position score
`sum_p Δ_S[p] · g_R[p]` needs Δ and g only from that column (`start`) on, and so do the points between
the two runs' input embeddings (equal before `start`). `prefix_keys_values` runs the shared columns once,
without gradients, and keeps every layer's keys and values; `suffix_pass` runs the columns from `start` on
over them, for P rows per pair (the target, the source, or points between their embeddings).

Gradients with respect to each head's own q/k/v input at every position come without per-head copies of
the residual: a zero leaf is added to each head's projection (one forward, one backward), and the leaf's
gradient goes back through that head's projection and `ln1` (its vector-Jacobian product at the
residual), `g_in[h] = J_ln1(x)^T (W[h] g_proj[h])`: exactly the gradient with respect to the head's own
pre-`ln1` input, as TransformerLens's split q/k/v inputs define it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from reward_lens.core.batching import Tokenized
from reward_lens.core.directions import reward_from_final_resid
from reward_lens.instruments.patching.path import PathNode
from reward_lens.model.frozen import gradients_on
from reward_lens.model.hooks import act_name
from reward_lens.model.sequence import SequenceContext

KeysValues = List[Tuple[torch.Tensor, torch.Tensor]]


def first_difference(target: Tokenized, source: Tokenized, seq: SequenceContext) -> int:
    """The first column where any row's tokens (or mask) differ between the two sides, at most the earliest
    readout (every readout is then recomputed)."""
    ids, mask = target.input_ids != source.input_ids, target.attention_mask != source.attention_mask
    differ = (ids | mask).any(0)
    first = int(differ.nonzero()[0, 0]) if bool(differ.any()) else differ.numel()
    return min(first, int(seq.readout.min()))


@torch.no_grad()
def prefix_keys_values(model, seq: SequenceContext, start: int) -> Optional[KeysValues]:
    """Post-RoPE keys and values [B, start, n_kv, d_head] of columns < start at every layer (None when
    start = 0): the columns both sides share."""
    if start == 0:
        return None
    x = model.embed(seq.input_ids[:, :start])
    out: KeysValues = []
    for block in model.blocks:
        cos, sin, allowed = seq.step_args(block, x.device)
        q, k, v = block.attn._rotated_qkv(block.ln1(x), cos[:, :start], sin[:, :start], hooked=False)
        out.append((k, v))
        if len(out) < len(model.blocks):  # the last block's output is never read
            z = block.attn.attend(q, k, v, allowed[:, :start, :start])
            x = block.readout_mlp(x + block.attn_out_from_z(z))
    return out


def _ln1_vjp(block, x: torch.Tensor, cotangents: torch.Tensor) -> torch.Tensor:
    """J_ln1(x)^T u for cotangents u [N, S, heads, d] at the residual x [N, S, d] (one per head)."""
    with torch.enable_grad():
        xe = x.detach()[:, :, None].expand_as(cotangents).clone().requires_grad_(True)
        (g,) = torch.autograd.grad(block.ln1(xe), xe, cotangents.to(xe.dtype))
    return g


def suffix_pass(
    model,
    seq: SequenceContext,
    start: int,
    kv: Optional[KeysValues],
    x0: torch.Tensor,
    receivers: Sequence[PathNode],
    direction: torch.Tensor,
    bias: torch.Tensor,
    record: Optional[Dict[str, torch.Tensor]] = None,
) -> Optional[torch.Tensor]:
    """Columns >= start of P rows per pair, x0 [B * P, S, d] their embedding there (row-major: pair b's
    rows are b*P .. b*P + P-1), over the shared columns' keys/values `kv`. Returns the gradients of the
    reward [B, n_receivers, S, d] with respect to each receiver's own input (a head's q/k/v input before
    ln1, an MLP's input, the final residual), summed over each pair's P rows (None with no receivers).
    `record` (when given) gets, from these columns, z, attn_out, mlp_out, resid_pre 0 and
    "reward" [B * P], what `sender_deltas` and the clean rewards read."""
    cfg, L = model.cfg, model.cfg.n_layers
    B = seq.input_ids.shape[0]
    N, S, d = x0.shape
    P = N // B
    rep = (lambda t: t.repeat_interleave(P, 0)) if P > 1 else (lambda t: t)
    readout = rep(seq.readout - start)
    layers = {r.layer for r in receivers if r.kind != "readout"}
    wanted = bool(receivers)

    def leaf(*shape):
        return torch.zeros(N, S, *shape, dtype=cfg.dtype, device=x0.device, requires_grad=True)

    leaves: Dict[tuple, torch.Tensor] = {}
    inputs: Dict[int, torch.Tensor] = {}
    gains = [n for b in model.blocks for n in b.output_gain_hooks()]
    kept: Dict[str, torch.Tensor] = {}

    def keep(t, hook):
        kept[hook.name] = t.detach()

    saved = [(n, keep) for n in gains] if record is not None else []
    with gradients_on("edge_attribution", enabled=wanted), model.hooks(fwd_hooks=saved):
        x = x0.detach()
        if record is not None:
            record[act_name("resid_pre", 0)] = x
        for l in range(L):
            block, attn = model.blocks[l], model.blocks[l].attn
            cos, sin, allowed = (rep(t[:, start:]) for t in seq.step_args(block, x.device))
            offsets = (0, 0, 0)
            if wanted and l in layers:
                inputs[l] = x
                leaves[("q", l)] = leaf(cfg.n_heads, cfg.d_head)
                leaves[("k", l)] = leaf(cfg.n_key_value_heads, cfg.d_head)
                leaves[("v", l)] = leaf(cfg.n_key_value_heads, cfg.d_head)
                offsets = (leaves[("q", l)], leaves[("k", l)], leaves[("v", l)])
            q, k, v = attn._rotated_qkv(block.ln1(x), cos, sin, hooked=False, offsets=offsets)
            if kv is not None:
                k, v = torch.cat([rep(kv[l][0]), k], 1), torch.cat([rep(kv[l][1]), v], 1)
            z = attn.attend(q, k, v, allowed)
            attn_out = block.attn_out_from_z(z)
            mid = x + attn_out
            leaves[("mlp", l)] = leaf(d) if wanted and l in layers else None
            x_next = block.readout_mlp(mid, leaves[("mlp", l)])
            if record is not None:
                record[act_name("z", l)], record[act_name("attn_out", l)] = z.detach(), attn_out.detach()
                record[act_name("mlp_out", l)] = (x_next - mid).detach()
            x = x_next
        leaves[("readout", None)] = leaf(d) if wanted else None
        final = x if leaves[("readout", None)] is None else x + leaves[("readout", None)]
        at = final[torch.arange(N, device=final.device), readout]
        reward = reward_from_final_resid(model, at, rep(direction), rep(bias))
        if record is not None:
            record["reward"] = reward.detach()
            record.update(kept)
        if not wanted:
            return None
        live = {key: t for key, t in leaves.items() if t is not None}
        grads = dict(zip(live, torch.autograd.grad(reward.sum(), list(live.values()), allow_unused=True)))
    return receiver_columns(model, receivers, grads, inputs, B, P)


def receiver_columns(model, receivers: Sequence[PathNode], grads, inputs, B: int, P: int) -> torch.Tensor:
    """[B, n_receivers, S, d]: the leaves' gradients as each receiver's input gradient (a head's projection
    gradient back through its W and ln1 at the block's input `inputs[layer]`), summed over the P rows."""
    cfg = model.cfg
    layers = sorted({r.layer for r in receivers if r.kind != "readout"})
    N, S, d = grads[("readout", None)].shape
    zero = torch.zeros(N, S, d, device=grads[("readout", None)].device)
    per_head: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for l in layers:
        attn = model.blocks[l].attn
        parts = [
            torch.einsum("nshe,hde->nshd", grads[(kind, l)], W) if grads[(kind, l)] is not None else None
            for kind, W in (("q", attn.W_Q), ("k", attn.W_K), ("v", attn.W_V))
        ]
        counts = (cfg.n_heads, cfg.n_key_value_heads, cfg.n_key_value_heads)
        parts = [p if p is not None else zero[:, :, None].expand(N, S, n, d) for p, n in zip(parts, counts)]
        g = _ln1_vjp(model.blocks[l], inputs[l], torch.cat(parts, 2)).float()
        per_head[l] = torch.split(g, list(counts), 2)
    cols = []
    for r in receivers:
        if r.kind == "readout":
            g = grads[("readout", None)]
        elif r.kind == "mlp":
            g = grads[("mlp", r.layer)]
        else:
            g = per_head[r.layer]["qkv".index(r.kind)][:, :, r.index]
        g = zero if g is None else g.float()
        cols.append(g.view(B, P, S, d).sum(1))
    return torch.stack(cols, 1)
