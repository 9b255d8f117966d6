"""The model running its readout token alone: what patching's fast paths recompute, owned by the model.

A patch at the readout changes the readout token from its layer on; under causal attention earlier
positions never see it and the reward never reads later ones, so the readout can be recomputed alone over
the keys and values the clean run cached. `ReadoutContext` is the positional state of that step, built once
per batch (transformers style: computed once, passed down): the readout positions, position ids, the RoPE
tables at the readout, per window size the positions the readout sees, and the cached post-RoPE keys and
values of every layer. The blocks' own one-token step (`TransformerBlock.readout_attn`, `readout_mlp`)
does the arithmetic, so a new positional scheme or head type is a model change only.

- `readout_sweep`: many alternative residuals, each resuming at its own (layer, stage), to the final
  residual at the readout (entries sorted by where they resume, so each block runs once on a prefix).
- `readout_with_inputs`: one layer recomputed with per-head substituted q/k/v inputs (and/or an MLP input
  difference), then the later layers: path patching's receivers, edge attribution's substitutions.
- `resid_mid_with_heads`: the readout's resid_mid when some heads' z are replaced (the linear output map).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from jaxtyping import Bool, Float, Int

from reward_lens.model.placement import block_device

PRE, MID = (
    0,
    1,
)  # where a readout recomputation enters its block: before attention, or between attention and MLP


@dataclass
class ReadoutEntry:
    """Where a readout recomputation resumes (block `layer`, at `stage` PRE or MID) and the readout
    residual [batch, d_model] it resumes from (`layer == n_layers`: already the final residual)."""

    layer: int
    stage: int
    state: torch.Tensor


@dataclass
class ReadoutContext:
    """The positional state of a batch's readout step, computed once (`readout_context`).

    readout [batch]: each row's readout position; position_ids [batch, pos]; cos / sin [batch, 1,
    rotary_dim]: the RoPE tables at the readout; sees[window] [batch, pos]: the positions the readout
    attends to under that window (None: full causal), its own excluded (its key is recomputed) and later
    ones irrelevant; kv[layer] = (post-RoPE keys, values) [batch, pos, n_kv, d_head] of the clean run.
    `on(device)` gives the tables on a placed model's other devices (copied once each)."""

    readout: Int[torch.Tensor, " batch"]
    position_ids: Int[torch.Tensor, "batch pos"]
    cos: torch.Tensor
    sin: torch.Tensor
    sees: Dict[Optional[int], Bool[torch.Tensor, "batch pos"]]
    kv: List[Tuple[torch.Tensor, torch.Tensor]]
    copies: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor, Dict]] = field(
        default_factory=dict, repr=False
    )

    @property
    def home(self) -> torch.device:
        return self.readout.device

    def on(
        self, device: torch.device
    ) -> Tuple[torch.Tensor, torch.Tensor, Dict[Optional[int], torch.Tensor]]:
        """(cos, sin, sees) on `device`."""
        if device not in self.copies:
            self.copies[device] = (
                self.cos.to(device),
                self.sin.to(device),
                {w: m.to(device) for w, m in self.sees.items()},
            )
        return self.copies[device]

    def layer_kv(self, layer: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        k, v = self.kv[layer]
        return k.to(device), v.to(device)


def kv_names(model) -> List[str]:
    """The hooks `readout_context(kv=...)` needs kept whole from a clean run: those the readout step attends
    to, layer by layer (keys, values)."""
    return [name for block in model.blocks for name in block.readout_kv_hooks]


def readout_context(
    model,
    tok_or_ids: Any,
    attention_mask: Optional[torch.Tensor] = None,
    readout: Optional[torch.Tensor] = None,
    *,
    kv: Optional[Mapping[str, torch.Tensor]] = None,
) -> ReadoutContext:
    """The positional state of recomputing each row's readout token alone, computed once: readout
    positions, position ids, RoPE tables, per-window visible positions, the clean run's cached keys and
    values. `tok_or_ids` is a tokenised batch (input_ids, attention_mask, readout) or ids; `readout`
    defaults to the model's readout rule. `kv` maps the `kv_names` hooks to the clean run's full
    activations (e.g. a capture's `full`); None runs that clean forward here."""
    if not model.has_readout_fast_path:
        raise ValueError(
            "recomputing the readout alone needs the blocks' one-token step (a native architecture)"
        )
    if hasattr(tok_or_ids, "input_ids"):
        ids, attention_mask, readout = tok_or_ids.input_ids, tok_or_ids.attention_mask, tok_or_ids.readout
    else:
        ids, attention_mask = model.checked_ids(tok_or_ids, attention_mask, warn=readout is None)
    B, T = ids.shape
    device = ids.device
    if readout is None:
        readout = model.readout_positions(ids, attention_mask)
    readout = readout.to(device)
    if kv is None:
        kv = clean_kv(model, ids, attention_mask, readout)
    mask, position_ids = model.prepare_inputs(B, T, attention_mask, None, device)
    cos, sin = model.rotary(position_ids[torch.arange(B, device=device), readout][:, None], model.cfg.dtype)
    idx = torch.arange(T, device=device)
    before = mask.bool() & (idx[None] < readout[:, None])
    sees = {
        w: before if w is None else before & (idx[None] > readout[:, None] - w)
        for w in set(model.cfg.window_sizes)
    }
    names = kv_names(model)
    pairs = [(kv[names[2 * l]], kv[names[2 * l + 1]]) for l in range(model.cfg.n_layers)]
    return ReadoutContext(readout, position_ids, cos, sin, sees, pairs)


@torch.no_grad()
def clean_kv(
    model, ids: torch.Tensor, attention_mask: torch.Tensor, readout: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """The `kv_names` activations of one clean forward (whole sequences)."""
    kept: Dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, hook) -> None:
        kept[hook.name] = tensor.detach()

    model.run_with_hooks(
        ids, attention_mask, readout_positions=readout, fwd_hooks=[(n, keep) for n in kv_names(model)]
    )
    return kept


def run_blocks(
    model, ctx: ReadoutContext, start: int, state: Float[torch.Tensor, "batch n d_model"]
) -> torch.Tensor:
    """The final residuals [batch, n, d_model] at the readout of `state` entering block `start`."""
    return readout_sweep(model, ctx, [ReadoutEntry(start, PRE, state[:, j]) for j in range(state.shape[1])])


def readout_sweep(model, ctx: ReadoutContext, entries: Sequence[ReadoutEntry], layer_changes: bool = False):
    """Final residuals [batch, n_entries, d_model] at the readout, each entry recomputed from where it
    resumes. Entries are sorted by (layer, stage), so block l runs its attention on the prefix that has
    reached (l, PRE) and its MLP on the prefix that has reached (l, MID), all alternatives as one batch.
    `layer_changes`: also return each block's change of every entry's state, [batch, n_entries, n_layers,
    d_model] (zero in the blocks before the entry resumes; an entry resuming at (l, MID): the MLP's alone)."""
    L = model.cfg.n_layers
    keys = [(e.layer, e.stage) for e in entries]
    order = sorted(range(len(entries)), key=keys.__getitem__)
    sorted_keys = [keys[p] for p in order]
    state = torch.stack([entries[p].state for p in order], 1).clone()  # [B, P, d]
    home = state.device
    changes = state.new_zeros(*state.shape[:2], L, state.shape[-1]) if layer_changes else None
    for l in range(sorted_keys[0][0], L):
        n_pre = bisect_left(sorted_keys, (l, MID))
        n_all = bisect_right(sorted_keys, (l, MID))
        block, here = model.blocks[l], block_device(model, l)  # a placed model: on the block's device
        state = state.to(here)
        before = state[:, :n_all].clone() if layer_changes and n_all else None
        if n_pre:
            cos, sin, sees = ctx.on(here)
            state[:, :n_pre] = block.readout_attn(state[:, :n_pre], cos, sin, *ctx.layer_kv(l, here), sees)
        if n_all:
            state[:, :n_all] = block.readout_mlp(state[:, :n_all])
            if before is not None:
                changes[:, :n_all, l] = (state[:, :n_all] - before).to(home)
    state = state.to(home)
    final = torch.empty_like(state)
    final[:, order] = state
    if not layer_changes:
        return final
    unsorted = torch.empty_like(changes)
    unsorted[:, order] = changes
    return final, unsorted


def readout_with_inputs(
    model,
    ctx: ReadoutContext,
    layer: int,
    resid_pre: Float[torch.Tensor, "batch n d_model"],
    *,
    q_input: Optional[Float[torch.Tensor, "batch n n_heads d_model"]] = None,
    k_input: Optional[Float[torch.Tensor, "batch n n_kv d_model"]] = None,
    v_input: Optional[Float[torch.Tensor, "batch n n_kv d_model"]] = None,
    mlp_delta: Optional[Float[torch.Tensor, "batch n d_model"]] = None,
) -> Float[torch.Tensor, "batch n d_model"]:
    """Final residuals [batch, n, d_model] at the readout of n alternatives of block `layer`: each head
    reads its own q/k/v input (the residual before ln1, as TransformerLens's split inputs; default
    `resid_pre`), `mlp_delta` is added to the MLP's input only, the skip connections carry `resid_pre`;
    the later blocks then run on what this block writes."""
    block, here = model.blocks[layer], block_device(model, layer)  # a placed model: on the block's device
    home = resid_pre.device
    cos, sin, sees = ctx.on(here)
    moved = [None if t is None else t.to(here) for t in (q_input, k_input, v_input)]
    mid = block.readout_attn(resid_pre.to(here), cos, sin, *ctx.layer_kv(layer, here), sees, *moved)
    post = block.readout_mlp(mid, None if mlp_delta is None else mlp_delta.to(here)).to(home)
    return post if layer + 1 == model.cfg.n_layers else run_blocks(model, ctx, layer + 1, post)


def resid_mid_with_heads(
    model,
    layer: int,
    resid_pre: Float[torch.Tensor, "batch d_model"],
    z: Float[torch.Tensor, "batch n_heads d_head"],
    heads: Sequence[int],
    new_z: Float[torch.Tensor, "batch k d_head"],
) -> Float[torch.Tensor, "batch k d_model"]:
    """The readout's resid_mid [batch, k, d_model] when head heads[j]'s z is new_z[:, j] (one head per
    alternative, the others at `z`): the output map is linear in each head's z, so the change is
    (new_z - z_h) W_O[h] before the block's own output step (Gemma-2's post-norm)."""
    block, here = model.blocks[layer], block_device(model, layer)  # a placed model: on the block's device
    home = resid_pre.device
    z, new_z, heads = z.to(here), new_z.to(here), list(heads)
    delta = torch.einsum("bkh,khm->bkm", new_z - z[:, heads], block.attn.W_O[heads])
    state = resid_pre[:, None].to(here) + block.attn_post(block.attn.project_z(z)[:, None] + delta)
    return state.to(home)
