"""The model's components, one class each, TransformerLens style.

Weights use TransformerLens's names and shapes (W_Q [n_heads, d_model, d_head], W_O [n_heads, d_head,
d_model], W_in/W_gate [d_model, d_mlp], W_out [d_mlp, d_model]) so that TransformerLens tools that read
them (ActivationCache.compute_head_results, stack_neuron_results) work unchanged. Hook names are the
public contract.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from transformer_lens.hook_points import HookPoint
from transformers.activations import ACT2FN

from reward_lens.model.config import RewardModelConfig


def head_major_param(n_heads: int, d_model: int, d_head: int) -> nn.Parameter:
    """A [n_heads, d_model, d_head] parameter stored as [n_heads, d_head, d_model] in memory.

    That storage is the transformers q_proj layout, so `W.transpose(1, 2).reshape(n*h, d_model)` is a
    free view and the projection is one plain GEMM. Only speed depends on this layout, not results.
    """
    return nn.Parameter(torch.empty(n_heads, d_head, d_model).transpose(1, 2))


def as_linear_weight(W: Float[torch.Tensor, "n d_model d_head"]) -> Float[torch.Tensor, "n_x_d_head d_model"]:
    return W.transpose(1, 2).reshape(-1, W.shape[1])


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), times (offset + w) unless the weight was folded away.

    hook_scale [batch, pos, 1] is kept in float32: dividing a cached residual by it reproduces the
    normalised input exactly, which is what the exact reward decomposition relies on.
    """

    b = None  # no bias (the generic path's LayerNorm final norm has one)
    centers_direction = False  # RMSNorm does not centre its input

    def __init__(self, cfg: RewardModelConfig, length: Optional[int] = None, weighted: bool = True):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.eps
        self.offset = cfg.norm_weight_offset
        self.w = nn.Parameter(torch.ones(length or cfg.d_model)) if weighted else None
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, length]

    @property
    def gain(self) -> Optional[torch.Tensor]:
        """What the normalised input is multiplied by, (offset + w); None when the weight was folded away.
        The one place the final norm's gain is formed (reward directions, head edits, attributions)."""
        return None if self.w is None else self.offset + self.w

    def frozen_gain(self, scale: Float[torch.Tensor, "... 1"]) -> Float[torch.Tensor, "... length"]:
        """The norm as a linear map with its scale frozen: out = x * frozen_gain(scale) (float32)."""
        gain = self.gain
        return (1.0 if gain is None else gain.float().to(scale.device)) / scale.float()

    def normalized(self, x: Float[torch.Tensor, "... length"]) -> Float[torch.Tensor, "... length"]:
        """x / scale(x) in float32, before any weight; hooks do not fire (readouts of many alternatives)."""
        xf = x.float()
        return xf / (xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def forward(self, x: Float[torch.Tensor, "... length"]) -> Float[torch.Tensor, "... length"]:
        xf = x.float()
        scale = self.hook_scale((xf.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        if self.w is None:
            return self.hook_normalized((xf / scale).to(x.dtype))
        if self.offset:  # Gemma multiplies in float32, then casts
            return (self.hook_normalized(xf / scale) * (self.offset + self.w.float())).to(x.dtype)
        return self.hook_normalized((xf / scale).to(x.dtype)) * self.w


class Embed(nn.Module):
    def __init__(self, cfg: RewardModelConfig):
        super().__init__()
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, input_ids: Int[torch.Tensor, "batch pos"]) -> Float[torch.Tensor, "batch pos d_model"]:
        embed = self.W_E[input_ids]
        if self.cfg.embed_scale is not None:  # Gemma: float32 scale (as transformers' buffer), then the dtype
            embed = embed * torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(embed.dtype)
        return embed

    def from_one_hot(
        self, one_hot: Float[torch.Tensor, "batch pos d_vocab"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The embedding of (relaxed) one-hot token vectors, one_hot @ W_E (scaled as `forward`):
        differentiable in `one_hot`, as gradient-guided token searches need."""
        embed = one_hot.to(self.W_E.dtype) @ self.W_E
        if self.cfg.embed_scale is not None:
            embed = embed * torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(embed.dtype)
        return embed


class RotaryEmbedding(nn.Module):
    """cos/sin tables from inverse frequencies computed at conversion by transformers' own RoPE code
    (llama3, linear, yarn, ... scaling), stored as a buffer so saved checkpoints carry them."""

    def __init__(self, cfg: RewardModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", torch.empty(cfg.rotary_dim // 2, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the frequencies (transformers keeps them float32 too).
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if not inv_freq.is_meta:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(
        self, position_ids: Int[torch.Tensor, "batch pos"], dtype: torch.dtype
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.cfg.rotary_attention_scaling
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(
    x: Float[torch.Tensor, "batch pos head d_head"], cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


class Attention(nn.Module):
    """Grouped-query attention with RoPE. hook_k / hook_v have n_key_value_heads heads."""

    def __init__(self, cfg: RewardModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        n, nkv, m, h = cfg.n_heads, cfg.n_key_value_heads, cfg.d_model, cfg.d_head
        self.W_Q = head_major_param(n, m, h)
        self.W_K = head_major_param(nkv, m, h)
        self.W_V = head_major_param(nkv, m, h)
        self.W_O = nn.Parameter(torch.empty(n, h, m))
        self.b_Q = nn.Parameter(torch.zeros(n, h))
        self.b_K = nn.Parameter(torch.zeros(nkv, h))
        self.b_V = nn.Parameter(torch.zeros(nkv, h))
        self.b_O = nn.Parameter(torch.zeros(m))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, h)
            self.k_norm = RMSNorm(cfg, h)
        self.window = cfg.window_sizes[layer]
        # the residual each head reads, before the block's ln1 (TransformerLens 4.x's names; the block-level
        # `blocks.{l}.hook_q_input` etc. are aliases): filled by `TransformerBlock.per_head_inputs`
        self.hook_attn_in = HookPoint()  # [batch, pos, n_heads, d_model], only with cfg.use_attn_in
        self.hook_q_input = HookPoint()  # [batch, pos, n_heads, d_model], only with cfg.use_split_qkv_input
        self.hook_k_input = HookPoint()  # [batch, pos, n_key_value_heads, d_model], likewise
        self.hook_v_input = HookPoint()
        self.hook_q = HookPoint()  # [batch, pos, n_heads, d_head]
        self.hook_k = HookPoint()  # [batch, pos, n_key_value_heads, d_head]
        self.hook_v = HookPoint()
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()  # [batch, n_heads, query_pos, key_pos]
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, n_heads, d_head]
        self.hook_result = HookPoint()  # [batch, pos, n_heads, d_model], only with cfg.use_attn_result

    # TransformerLens's raw grouped-query names, one kv head each (here W_K / W_V / b_K / b_V are those raw
    # parameters; the model-level `model.W_K` repeats them to n_heads)
    @property
    def _W_K(self) -> torch.Tensor:
        return self.W_K

    @property
    def _W_V(self) -> torch.Tensor:
        return self.W_V

    @property
    def _b_K(self) -> torch.Tensor:
        return self.b_K

    @property
    def _b_V(self) -> torch.Tensor:
        return self.b_V

    def _project(self, x, W, b):
        out = F.linear(x, as_linear_weight(W))
        return out.view(*x.shape[:-1], W.shape[0], W.shape[2]) + b

    def _rotate_qkv(self, q, k, v, cos, sin, hooked: bool):
        """Projections q, k, v through the q/k norms and RoPE, the hook points firing if `hooked`."""
        hook = (lambda point, t: point(t)) if hooked else (lambda point, t: t)
        q, k, v = hook(self.hook_q, q), hook(self.hook_k, k), hook(self.hook_v, v)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = hook(self.hook_rot_q, apply_rotary(q, cos, sin))
        k = hook(self.hook_rot_k, apply_rotary(k, cos, sin))
        return q, k, v

    def _project_inputs(self, xq, xk, xv):
        """q, k, v projections of inputs shared by every head ([batch, pos, d_model]) or one per head."""

        def project(x, W, b):
            return self._project(x, W, b) if x.dim() == 3 else torch.einsum("...nd,ndh->...nh", x, W) + b

        q = project(xq, self.W_Q, self.b_Q)
        return q, project(xk, self.W_K, self.b_K), project(xv, self.W_V, self.b_V)

    def _rotated_qkv(self, x, cos, sin, hooked: bool = True, offsets=(0, 0, 0)):
        """q, k (after q/k norms and RoPE) and v of `x`; `hooked=False` skips the hook points (the
        patching fast path's rows are alternatives of one token, not positions). `offsets` (dq, dk, dv) are
        added to the projections, before the norms (edge attribution's leaves for per-head gradients)."""
        dq, dk, dv = offsets
        q = self._project(x, self.W_Q, self.b_Q + dq)
        k = self._project(x, self.W_K, self.b_K + dk)
        v = self._project(x, self.W_V, self.b_V + dv)
        return self._rotate_qkv(q, k, v, cos, sin, hooked)

    def readout_qkv(self, xq, xk, xv, cos, sin):
        """q, k (after q/k norms and RoPE) and v of alternative readout tokens; hooks do not fire. Each
        input is either shared by every head ([..., d_model]: one GEMM) or one per head ([..., n, d_model]
        with n = n_heads for `xq`, n_key_value_heads for `xk`/`xv`): path patching changes one head's
        input."""
        return self._rotate_qkv(*self._project_inputs(xq, xk, xv), cos, sin, hooked=False)

    def soft_cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Gemma-2's cap * tanh(scores / cap) of the scaled scores (identity without a cap)."""
        cap = self.cfg.attn_scores_soft_cap
        return scores if cap is None else torch.tanh(scores / cap) * cap

    def _split_rotated_qkv(self, xq, xk, xv, cos, sin):
        """q, k (after q/k norms and RoPE) and v when each head reads its own normalised input (`xq`
        [batch, pos, n_heads, d_model], `xk` / `xv` per kv head), the hooks firing as in `_rotated_qkv`."""
        return self._rotate_qkv(*self._project_inputs(xq, xk, xv), cos, sin, hooked=True)

    def forward(
        self,
        x: Optional[Float[torch.Tensor, "batch pos d_model"]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: Bool[torch.Tensor, "batch query_pos key_pos"],
        per_head: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The attention output of the normalised input `x`, or of per-head inputs `per_head` = (q, k, v
        inputs, [batch, pos, heads, d_model]: the block's split inputs) when given."""
        z = self.heads_z(x, cos, sin, allowed, per_head)
        if self.cfg.use_attn_result:
            result = self.hook_result(torch.einsum("bqnh,nhm->bqnm", z, self.W_O))
            return result.sum(-2) + self.b_O
        return self.project_z(z)

    def heads_z(
        self,
        x: Optional[Float[torch.Tensor, "batch pos d_model"]],
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: Bool[torch.Tensor, "batch query_pos key_pos"],
        per_head: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    ) -> Float[torch.Tensor, "batch pos n_heads d_head"]:
        """Every head's z (as hook_z holds it) over the whole sequence, from `x` or `per_head` (`forward`)."""
        if per_head is None:
            q, k, v = self._rotated_qkv(x, cos, sin)
        else:
            q, k, v = self._split_rotated_qkv(*per_head, cos, sin)
        return self.hook_z(self.attend(q, k, v, allowed))

    def attend(self, q, k, v, allowed: Bool[torch.Tensor, "batch query_pos key_pos"]) -> torch.Tensor:
        """z of queries over keys/values; key_pos may exceed query_pos (queries continuing cached keys)."""
        cfg = self.cfg
        explicit = cfg.attn_scores_soft_cap is not None or self.hook_attn_scores.has_hooks()
        if explicit or self.hook_pattern.has_hooks():
            return self._explicit_attention(q, k, v, allowed)
        return F.scaled_dot_product_attention(  # fused kernel; equal to the explicit path (tested)
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=allowed[:, None],
            scale=1.0 / cfg.attn_scale,
            enable_gqa=cfg.n_heads != cfg.n_key_value_heads,
        ).transpose(1, 2)

    def forward_with_past(
        self,
        x: Float[torch.Tensor, "n suffix d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: Float[torch.Tensor, "m prefix n_kv d_head"],
        past_v: Float[torch.Tensor, "m prefix n_kv d_head"],
        allowed: Bool[torch.Tensor, "m suffix key_pos"],
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(attention output, own keys, own values) of n suffixes continuing cached prefixes (m = 1: one
        shared by every row; m = n: one per row): each suffix position attends to the prefix's keys/values
        (as hook_rot_k / hook_v hold them) and to the suffix up to itself, as `allowed` says; no hooks."""
        cfg = self.cfg
        q, k, v = self._rotated_qkv(x, cos, sin, hooked=False)
        n, S, H, d = q.shape
        qg = q.reshape(n, S, cfg.n_key_value_heads, H // cfg.n_key_value_heads, d)
        # One prefix shared by every row: one GEMM per key/value head, never copied per row.
        shared = past_k.shape[0] == 1
        past, (pk, pv) = ("pkd", (past_k[0], past_v[0])) if shared else ("npkd", (past_k, past_v))
        prefix = torch.einsum(f"nskgd,{past}->nskgp", qg, pk)
        own = torch.einsum("nskgd,ntkd->nskgt", qg, k)  # each row's suffix keys
        scores = self.soft_cap(torch.cat([prefix, own], dim=-1) / cfg.attn_scale)
        scores = scores.masked_fill(~allowed[:, :, None, None, :], torch.finfo(scores.dtype).min)
        pattern = F.softmax(scores.float(), dim=-1).to(q.dtype)
        z = torch.einsum(f"nskgp,{past}->nskgd", pattern[..., : pk.shape[-3]], pv)
        z = z + torch.einsum("nskgt,ntkd->nskgd", pattern[..., pk.shape[-3] :], v)
        return self.project_z(z.reshape(n, S, H, d)), k, v

    def project_z(self, z: Float[torch.Tensor, "... n_heads d_head"]) -> Float[torch.Tensor, "... d_model"]:
        """The attention output map, sum_h z_h W_O[h] + b_O (linear in each head's z)."""
        return z.reshape(*z.shape[:-2], -1) @ self.W_O.reshape(-1, self.cfg.d_model) + self.b_O

    def _explicit_attention(self, q, k, v, allowed):
        cfg = self.cfg
        group = cfg.n_heads // cfg.n_key_value_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = self.soft_cap(torch.einsum("bqnh,bknh->bnqk", q, k) / cfg.attn_scale)
        scores = self.hook_attn_scores(scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min))
        pattern = self.hook_pattern(F.softmax(scores.float(), dim=-1).to(q.dtype))
        return torch.einsum("bnqk,bknh->bqnh", pattern, v)

    def forward_readout(
        self,
        x: Float[torch.Tensor, "batch n_query d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: Float[torch.Tensor, "batch key_pos n_kv d_head"],
        past_v: Float[torch.Tensor, "batch key_pos n_kv d_head"],
        sees: Mapping[Optional[int], Bool[torch.Tensor, "batch key_pos"]],
        xk: Optional[torch.Tensor] = None,
        xv: Optional[torch.Tensor] = None,
    ) -> Float[torch.Tensor, "batch n_query n_heads d_head"]:
        """z of n_query alternative versions of one token per sequence (the readout), each attending to
        the cached keys/values of the other positions plus its own fresh key/value.

        `x` is the normalised input of the queries, `xk`/`xv` of the token's own key/value (default `x`);
        each [batch, n_query, d_model] (shared by the heads) or [..., n, d_model] (one per head, see
        `readout_qkv`). `cos`/`sin` [batch, 1, rotary_dim] are the RoPE tables at the token's position;
        `past_k` the keys as `hook_rot_k` holds them (after qk-norm and RoPE), `past_v` as `hook_v`; `sees`
        maps each window size to the positions the token sees, its own excluded (its key is recomputed).
        Hooks on this module do not fire: rows are alternatives, not positions. Equal to a full forward
        at the token (tested); `reward_lens.model.recompute` builds the arguments.
        """
        cfg = self.cfg
        past_allowed = sees[self.window]
        nkv, group = cfg.n_key_value_heads, cfg.n_heads // cfg.n_key_value_heads
        q, k, v = self.readout_qkv(x, x if xk is None else xk, x if xv is None else xv, cos, sin)
        B, P, _, h = q.shape
        T = past_k.shape[1]
        qg = q.reshape(B, P, nkv, group, h).permute(0, 2, 1, 3, 4)  # [B, nkv, P, group, h]
        past = qg.reshape(B, nkv, P * group, h) @ past_k.permute(0, 2, 3, 1)  # [B, nkv, P*group, T]
        own = (qg * k.permute(0, 2, 1, 3)[:, :, :, None]).sum(-1).reshape(B, nkv, P * group, 1)
        scores = self.soft_cap(torch.cat([past, own], dim=-1) / cfg.attn_scale)
        allowed = torch.cat([past_allowed, past_allowed.new_ones(B, 1)], dim=-1)[:, None, None]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        pattern = F.softmax(scores.float(), dim=-1).to(q.dtype)
        z = pattern[..., :T] @ past_v.permute(0, 2, 1, 3)  # [B, nkv, P*group, h]
        own_v = v.permute(0, 2, 1, 3)[:, :, :, None]  # [B, nkv, P, 1, h]
        z = z.reshape(B, nkv, P, group, h) + pattern[..., T:].reshape(B, nkv, P, group, 1) * own_v
        return z.permute(0, 2, 1, 3, 4).reshape(B, P, cfg.n_heads, h)


class GatedMLP(nn.Module):
    """out = (act(x W_gate) * (x W_in + b_in)) W_out + b_out, i.e. down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: RewardModelConfig):
        super().__init__()
        self.cfg = cfg
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_gate = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.act = ACT2FN[cfg.act_fn]
        self.hook_pre = HookPoint()  # gate pre-activation [batch, pos, d_mlp]
        self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()  # neuron activations [batch, pos, d_mlp]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        pre = self.hook_pre(x @ self.W_gate)
        pre_linear = self.hook_pre_linear(x @ self.W_in + self.b_in)
        post = self.hook_post(self.act(pre) * pre_linear)
        return post @ self.W_out + self.b_out


class TransformerBlock(nn.Module):
    """Pre-norm block: resid_mid = resid_pre + attn_post(attn(ln1(resid_pre))), resid_post = resid_mid +
    mlp_post(mlp(ln2(resid_mid))). `attn_post`/`mlp_post` are Gemma-2's post-norms (identity elsewhere):
    the block is the one place that knows about them. It also owns its one-token readout step over
    cached keys/values (`readout_attn`, `readout_mlp`), used by the patching fast path."""

    def __init__(self, cfg: RewardModelConfig, layer: int):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        weighted = cfg.normalization_type == "RMS"
        self.ln1 = RMSNorm(cfg, weighted=weighted)
        self.attn = Attention(cfg, layer)
        self.ln2 = RMSNorm(cfg, weighted=weighted)
        self.mlp = GatedMLP(cfg)
        if cfg.post_norms:  # Gemma-2: their weights act after the scale, so they are never folded
            self.ln1_post = RMSNorm(cfg)
            self.ln2_post = RMSNorm(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_in = HookPoint()  # [batch, pos, d_model] before ln2, only with cfg.use_hook_mlp_in
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    @property
    def submodules(self) -> Dict[str, nn.Module]:
        """The block's parts as TransformerLens's analysis tools ask for them: with post-norms, `ln1_post`
        owns `hook_attn_out` (`hook_aliases`), so `transformer_lens.patching.get_act_patch_direct_path`
        refuses the block (a head's write is not z @ W_O there) instead of giving a wrong number."""
        parts: Dict[str, nn.Module] = {"attn": self.attn, "mlp": self.mlp}
        return {**parts, "ln1_post": self.ln1_post} if self.cfg.post_norms else parts

    @property
    def hook_aliases(self) -> Dict[str, str]:
        return {"hook_attn_out": "ln1_post.hook_normalized"} if self.cfg.post_norms else {}

    def _post_norm(self, which: str) -> Optional[RMSNorm]:
        return getattr(self, f"ln{1 if which == 'attn' else 2}_post") if self.cfg.post_norms else None

    def attn_post(self, raw: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        """What the attention's output map writes becomes attn_out (Gemma-2: through ln1_post)."""
        return self.ln1_post(raw) if self.cfg.post_norms else raw

    def mlp_post(self, raw: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        return self.ln2_post(raw) if self.cfg.post_norms else raw

    def attn_out_from_z(
        self, z: Float[torch.Tensor, "... n_heads d_head"]
    ) -> Float[torch.Tensor, "... d_model"]:
        """attn_out (as hook_attn_out holds it) from the heads' z (as hook_z holds it)."""
        return self.attn_post(self.attn.project_z(z))

    def forward(self, resid_pre, cos, sin, allowed):
        resid_pre = self.hook_resid_pre(resid_pre)
        per_head = self.per_head_inputs(resid_pre)
        if per_head is None:
            raw = self.attn(self.ln1(resid_pre), cos, sin, allowed)
        else:
            raw = self.attn(None, cos, sin, allowed, per_head=tuple(self.ln1(x) for x in per_head))
        resid_mid = self.hook_resid_mid(resid_pre + self.hook_attn_out(self.attn_post(raw)))
        mlp_in = self.hook_mlp_in(resid_mid.clone()) if self.cfg.use_hook_mlp_in else resid_mid
        mlp_out = self.mlp_post(self.mlp(self.ln2(mlp_in)))
        return self.hook_resid_post(resid_mid + self.hook_mlp_out(mlp_out))

    def per_head_inputs(self, resid_pre: Float[torch.Tensor, "batch pos d_model"]):
        """TransformerLens's per-head copies of resid_pre, before `ln1`: (q, k, v) inputs [batch, pos, heads,
        d_model] with `use_split_qkv_input` (attn.hook_q_input per query head, attn.hook_k_input /
        attn.hook_v_input per kv head) or `use_attn_in` (attn.hook_attn_in per query head; kv head j reads
        slot j, as TransformerLens 4.x's bridge); None when neither is on."""
        cfg = self.cfg
        if not (cfg.use_split_qkv_input or cfg.use_attn_in):
            return None
        n, nkv = cfg.n_heads, cfg.n_key_value_heads

        def copies(heads: int) -> torch.Tensor:
            return resid_pre[:, :, None, :].expand(-1, -1, heads, -1).clone()

        attn = self.attn
        if cfg.use_split_qkv_input:
            q_input, k_input = attn.hook_q_input(copies(n)), attn.hook_k_input(copies(nkv))
            return q_input, k_input, attn.hook_v_input(copies(nkv))
        attn_in = attn.hook_attn_in(copies(n))
        return attn_in, attn_in[:, :, :nkv], attn_in[:, :, :nkv]

    def forward_with_past(self, resid, cos, sin, past_k, past_v, allowed, rows=None):
        """(resid_post, the suffix's keys, its values) of n suffixes over cached prefixes (`Attention.
        forward_with_past`), no hooks; `rows` [n, suffix]: where the MLP runs (padding keeps resid_mid)."""
        attn, k, v = self.attn.forward_with_past(self.ln1(resid), cos, sin, past_k, past_v, allowed)
        mid = resid + self.attn_post(attn)
        out = self.readout_mlp(mid) if rows is None else mid.index_put((rows,), self.readout_mlp(mid[rows]))
        return out, k, v

    # ------------------------------------------------------------------ the one-token readout step
    @property
    def readout_kv_hooks(self) -> Tuple[str, str]:
        """The hooks whose full-sequence values `readout_attn` attends to: post-RoPE keys and values."""
        return self.attn.hook_rot_k.name, self.attn.hook_v.name

    def readout_attn(
        self,
        resid: Float[torch.Tensor, "batch n_query d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        sees: Mapping[Optional[int], Bool[torch.Tensor, "batch key_pos"]],
        q_input: Optional[torch.Tensor] = None,
        k_input: Optional[torch.Tensor] = None,
        v_input: Optional[torch.Tensor] = None,
    ) -> Float[torch.Tensor, "batch n_query d_model"]:
        """resid_mid of n_query alternative residuals of one token per sequence, attending to cached
        keys/values (see `Attention.forward_readout`); hooks do not fire. `q_input` [batch, n_query,
        n_heads, d_model] / `k_input`, `v_input` [..., n_key_value_heads, d_model]: the residual each head
        reads instead of `resid` (normalised by ln1 here, as TransformerLens's split q/k/v inputs); the
        skip connection always carries `resid`."""
        x = self.ln1(resid)
        xq, xk, xv = (x if t is None else self.ln1(t) for t in (q_input, k_input, v_input))
        z = self.attn.forward_readout(xq, cos, sin, past_k, past_v, sees, xk, xv)
        return resid + self.attn_out_from_z(z)

    def z_with_inputs(
        self,
        resid: Float[torch.Tensor, "batch pos d_model"],
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: Bool[torch.Tensor, "batch query_pos key_pos"],
        q_input: Optional[torch.Tensor] = None,
        k_input: Optional[torch.Tensor] = None,
        v_input: Optional[torch.Tensor] = None,
    ) -> Float[torch.Tensor, "batch pos n_heads d_head"]:
        """Every head's z over the whole sequence when each head reads its own input at every position
        (`q_input` [batch, pos, n_heads, d_model], `k_input` / `v_input` [..., n_key_value_heads, d_model]:
        the residual before ln1, as TransformerLens's split inputs; default `resid`). The block's output is
        then `resid + attn_out_from_z(z)` and `readout_mlp` (position-wise) on that."""
        if q_input is None and k_input is None and v_input is None:
            return self.attn.heads_z(self.ln1(resid), cos, sin, allowed)
        x = self.ln1(resid)
        counts = (self.cfg.n_heads, self.cfg.n_key_value_heads, self.cfg.n_key_value_heads)
        per_head = tuple(
            x[:, :, None].expand(-1, -1, n, -1) if t is None else self.ln1(t)
            for t, n in zip((q_input, k_input, v_input), counts)
        )
        return self.attn.heads_z(None, cos, sin, allowed, per_head=per_head)

    def readout_mlp(
        self, resid_mid: Float[torch.Tensor, "... d_model"], mlp_delta: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, "... d_model"]:
        """resid_post from resid_mid, position-wise (hooks do not fire); `mlp_delta` is added to the MLP's
        input only (the skip connection carries `resid_mid`)."""
        mlp_in = resid_mid if mlp_delta is None else resid_mid + mlp_delta
        return resid_mid + self.mlp_post(self.mlp(self.ln2(mlp_in)))

    # ------------------------------------------------------------------ linear views of the outputs
    def output_gain_hooks(self) -> Tuple[str, ...]:
        """The hooks `output_gain` needs (the post-norms' scales; none without post-norms)."""
        norms = [self._post_norm(w) for w in ("attn", "mlp")]
        return tuple(n.hook_scale.name for n in norms if n is not None)

    def output_gain(self, which: str, acts: Dict[str, torch.Tensor]) -> Union[float, torch.Tensor]:
        """What the raw output of `which` ("attn" or "mlp") is multiplied by on its way to the residual,
        with any post-norm's scale frozen at its value in `acts` (hook name -> tensor): 1 without one."""
        norm = self._post_norm(which)
        return 1.0 if norm is None else norm.frozen_gain(acts[norm.hook_scale.name])

    def residual_writers(self) -> List[Tuple[str, nn.Parameter]]:
        """(name, parameter) of every map and bias whose output is added to the residual as is: the
        parameters a weight edit of what the block writes must change. Refused with post-norms, whose
        outputs pass a norm first (then no weight edit is exact)."""
        if self.cfg.post_norms:
            raise ValueError(
                "with post-norms (Gemma-2) the written outputs pass a norm after their maps; a residual "
                "edit cannot be a weight edit there. Edit the head instead (where='head')"
            )
        return [
            ("attn.W_O", self.attn.W_O),
            ("attn.b_O", self.attn.b_O),
            ("mlp.W_out", self.mlp.W_out),
            ("mlp.b_out", self.mlp.b_out),
        ]


def attention_masks(
    attention_mask: Int[torch.Tensor, "batch pos"], window_sizes, query_len: Optional[int] = None
) -> Dict[Optional[int], Bool[torch.Tensor, "batch query key"]]:
    """Which keys each query may attend to, per distinct window size (None = full causal).

    Padded keys are masked; a query whose every key would be masked (a left-pad position) may attend
    to itself, so no row is empty and no NaN can reach real tokens through 0 * NaN.
    """
    T = attention_mask.shape[-1]
    idx = torch.arange(T, device=attention_mask.device)
    q_idx = idx[-query_len:] if query_len is not None else idx
    causal = idx[None, :] <= q_idx[:, None]
    valid_key = attention_mask.bool()[:, None, :]
    own = idx[None, :] == q_idx[:, None]
    masks = {}
    for window in set(window_sizes):
        allowed = causal if window is None else causal & (idx[None, :] > q_idx[:, None] - window)
        masks[window] = (allowed[None] & valid_key) | own[None]
    return masks
