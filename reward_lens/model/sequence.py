"""The model recomputing whole sequences from a layer on: what all-position path patching, edge attribution
and circuits need (a receiver's input shifted at every position, everything downstream recomputed).

`SequenceContext` is a batch's positional state for the whole sequence, computed once (transformers
style): ids, mask, readout positions, RoPE tables and one visibility mask per window size. `repeat(n)`
gives it for n alternatives of every row (row-major: row b's alternatives are rows b*n .. b*n + n-1), so
the alternatives of a batch run as one batch. The blocks' own steps do the arithmetic
(`TransformerBlock.z_with_inputs`, `attn_out_from_z`, `readout_mlp`, the block's forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from jaxtyping import Bool, Float, Int

from reward_lens.model.components import attention_masks
from reward_lens.model.placement import block_device


@dataclass
class SequenceContext:
    """input_ids / attention_mask [batch, pos]; readout [batch]; cos / sin: the RoPE tables of every
    position; masks[window] [batch, pos, pos]: which keys each query attends to."""

    input_ids: Int[torch.Tensor, "batch pos"]
    attention_mask: Int[torch.Tensor, "batch pos"]
    readout: Int[torch.Tensor, " batch"]
    cos: torch.Tensor
    sin: torch.Tensor
    masks: Dict[Optional[int], Bool[torch.Tensor, "batch pos pos"]]

    def repeat(self, n: int) -> "SequenceContext":
        """The context of n alternatives of each row (row b -> rows b*n .. b*n + n - 1)."""

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(n, dim=0)

        return SequenceContext(
            rep(self.input_ids),
            rep(self.attention_mask),
            rep(self.readout),
            rep(self.cos),
            rep(self.sin),
            {w: rep(m) for w, m in self.masks.items()},
        )

    def step_args(self, block, device: torch.device):
        """(cos, sin, allowed) of `block` on `device`."""
        return self.cos.to(device), self.sin.to(device), self.masks[block.attn.window].to(device)


def sequence_context(model, tok) -> SequenceContext:
    """The whole-sequence positional state of a tokenised batch (`Tokenized`: input_ids, attention_mask,
    readout): ids, mask, readout, RoPE tables and masks as the model's forward computes them, once;
    `.repeat(n)` for n alternatives per row."""
    ids = tok.input_ids
    mask, position_ids = model.prepare_inputs(
        ids.shape[0], ids.shape[1], tok.attention_mask, None, ids.device
    )
    cos, sin = model.rotary(position_ids, model.cfg.dtype)
    masks = attention_masks(mask, model.cfg.window_sizes)
    return SequenceContext(ids, mask, tok.readout.to(ids.device), cos, sin, masks)


def final_from_layer(
    model,
    ctx: SequenceContext,
    layer: int,
    resid_pre: Float[torch.Tensor, "batch pos d_model"],
    *,
    q_input: Optional[Float[torch.Tensor, "batch pos n_heads d_model"]] = None,
    k_input: Optional[Float[torch.Tensor, "batch pos n_kv d_model"]] = None,
    v_input: Optional[Float[torch.Tensor, "batch pos n_kv d_model"]] = None,
    mlp_delta: Optional[Float[torch.Tensor, "batch pos d_model"]] = None,
) -> Float[torch.Tensor, "batch d_model"]:
    """The final residual at the readout [batch, d_model] when block `layer` runs with each head reading its
    own q/k/v input at every position (the residual before ln1; default `resid_pre`) and `mlp_delta` added
    to its MLP's input at every position (the skip connections carry the block's own residual), and every
    later block runs as in a forward (all-position path patching's receivers). Hooks inside the attention
    fire as in a forward."""
    home = resid_pre.device
    block, here = model.blocks[layer], block_device(model, layer)
    cos, sin, allowed = ctx.step_args(block, here)
    moved = [None if t is None else t.to(here) for t in (q_input, k_input, v_input)]
    x = resid_pre.to(here)
    mid = x + block.attn_out_from_z(block.z_with_inputs(x, cos, sin, allowed, *moved))
    resid = block.readout_mlp(mid, None if mlp_delta is None else mlp_delta.to(here))
    for l in range(layer + 1, model.cfg.n_layers):
        block, here = model.blocks[l], block_device(model, l)
        resid = block(resid.to(here), *ctx.step_args(block, here))
    resid = resid.to(home)
    rows = torch.arange(resid.shape[0], device=home)
    return resid[rows, ctx.readout.to(home)]
