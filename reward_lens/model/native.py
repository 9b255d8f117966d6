"""NativeRewardModel: a TransformerLens-style decoder whose unembed is a reward head.

    resid = hook_embed(W_E[ids])
    for block in blocks: resid = resid + attn_out + mlp_out      (pre-norm blocks, hooks on every term)
    reward = reward_head(ln_final(resid), readout)               (readout = rightmost non-pad token)

Built on TransformerLens's kept infrastructure (HookedRootModule, HookPoint, ActivationCache), so
`run_with_cache`, `run_with_hooks` and `transformer_lens.patching` work on it unchanged.

This is the computation alone: the public `HookedRewardModel` is this class with its checkpoint I/O
(`from_pretrained`, `save_pretrained`, ...), defined one layer up where the loading code lives, so the
model never depends on the layers above it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model import recompute, sequence, suffix
from reward_lens.model.base import RewardModelBase
from reward_lens.model.components import Embed, RMSNorm, RotaryEmbedding, TransformerBlock, attention_masks
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads import build_head
from reward_lens.model.placement import head_device, module_device
from reward_lens.model.tl_compat import (
    TransformerLensConveniences,
    check_forward_input,
    stacked_weight,
    text_input,
)
from reward_lens.model.validation import check_attention_mask, checked_arguments


class NativeRewardModel(TransformerLensConveniences, RewardModelBase):
    """The native hooked reward model: every TransformerLens hook down to single heads and neurons."""

    has_head_hooks = True
    has_readout_fast_path = True

    def __init__(self, cfg: RewardModelConfig, tokenizer: Any = None):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]: the embedding as added to the residual
        self.rotary = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([TransformerBlock(cfg, l) for l in range(cfg.n_layers)])
        self.ln_final = RMSNorm(cfg, weighted=cfg.normalization_type == "RMS")
        self.reward_head = build_head(cfg)
        self.setup()
        self.eval()

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input: Union[Int[torch.Tensor, "batch pos"], Float[torch.Tensor, "batch pos d_model"]],
        attention_mask: Optional[Int[torch.Tensor, "batch pos"]] = None,
        position_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        *,
        input_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        readout_positions: Optional[Int[torch.Tensor, " batch"]] = None,
        return_type: Optional[str] = "reward",
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
    ) -> Optional[torch.Tensor]:
        """Rewards [batch] (or [batch, n_outputs]); the residual before block `stop_at_layer` if given.

        `input`: ids, or a text / list of texts tokenised as `to_tokens(text, prepend_bos, padding_side)`
        (TransformerLens's meaning: BOS + the text, no chat template; the reward read at its last token).
        With `start_at_layer=l`, `input` is the residual entering block l; pass `input_ids` too (or
        `readout_positions`) so the readout is found, and the mask inferred, as in a full run.
        Position ids default to the count of attended tokens before each position, so a left-padded
        sequence gets the same reward as the unpadded one. Ids without `attention_mask`: the leading pad
        run of each row is masked (`infer_attention_mask`). `return_type` is TL's keyword: "reward" or
        "logits" (both the reward), None (the final norm runs, its hooks fire, the head is skipped,
        nothing is returned).
        """
        input, attention_mask = text_input(self, input, attention_mask, prepend_bos, padding_side)
        check_forward_input(input, return_type)
        if start_at_layer is None:
            input_ids, attention_mask = self.checked_ids(
                input, attention_mask, warn=readout_positions is None
            )
            residual = self.hook_embed(self.embed(input_ids))
            start_at_layer = 0
        else:
            residual = input
            if (
                attention_mask is not None
            ):  # shape only: a mid-model restart reuses a checked mask (no device sync)
                attention_mask = check_attention_mask(attention_mask, tuple(residual.shape[:2]), values=False)
            elif input_ids is not None:  # the mask a full forward would infer from the same ids
                input_ids, attention_mask = self.checked_ids(input_ids, None, warn=readout_positions is None)
        batch, T = residual.shape[:2]
        attention_mask, position_ids = self.prepare_inputs(
            batch, T, attention_mask, position_ids, residual.device
        )
        cos, sin = self.rotary(position_ids, residual.dtype)
        masks = attention_masks(attention_mask, self.cfg.window_sizes)
        stop = self.cfg.n_layers if stop_at_layer is None else stop_at_layer
        shared = {residual.device: (cos, sin, masks)}  # per device: a placed model's blocks span several
        for block in self.blocks[start_at_layer:stop]:
            device = module_device(block, residual.device)
            if device not in shared:
                shared[device] = (cos.to(device), sin.to(device), {w: m.to(device) for w, m in masks.items()})
            cos_d, sin_d, masks_d = shared[device]
            residual = block(residual.to(device), cos_d, sin_d, masks_d[block.attn.window])
        if stop_at_layer is not None:
            return residual.to(self.cfg.device)
        device = head_device(self)
        normalized = self.ln_final(residual.to(device))  # for return_type=None too, as in TransformerLens
        if return_type is None:
            return None
        if readout_positions is None:
            readout_positions = self.readout_positions(input_ids, attention_mask)
        ids = input_ids.to(device) if input_ids is not None else None
        rewards = self.reward_head(normalized, readout_positions.to(device), input_ids=ids)
        return rewards.to(self.cfg.device)

    # ------------------------------------------------------------------ the readout token alone
    # A method that only calls its module function is that function, the model its first argument: one
    # signature and docstring, beside the code that computes it (`readout_sweep` checks its flag first).
    readout_context = recompute.readout_context
    readout_kv_names = recompute.kv_names

    @checked_arguments(flags=("layer_changes",))
    def readout_sweep(
        self,
        ctx: recompute.ReadoutContext,
        entries: Sequence[recompute.ReadoutEntry],
        layer_changes: bool = False,
    ):
        """Final residuals [batch, n, d_model] at the readout of many alternative residuals, each resuming
        at its own block and stage (`recompute.ReadoutEntry`); only the readout token is recomputed.
        `layer_changes`: (final, each block's change of every row [batch, n, n_layers, d_model])."""
        return recompute.readout_sweep(self, ctx, entries, layer_changes)

    readout_with_inputs = recompute.readout_with_inputs
    resid_mid_with_heads = recompute.resid_mid_with_heads

    # ------------------------------------------------------------------ whole sequences from a layer on
    sequence_context = sequence.sequence_context
    final_from_layer = sequence.final_from_layer

    # ------------------------------------------------------------------ suffixes over a shared prefix
    prefix_cache = suffix.prefix_cache
    shared_prefix_run = suffix.shared_prefix_run
    suffix_rewards = suffix.suffix_rewards

    def embed_one_hot(
        self, one_hot: Float[torch.Tensor, "batch pos d_vocab"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The embedding of (relaxed) one-hot vectors, differentiable (gradient-guided token search)."""
        return self.embed.from_one_hot(one_hot)

    @checked_arguments(flags=("mlp_input", "include_mlp_biases"))
    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> torch.Tensor:
        """Sum of the attention and MLP output biases written into the residual before `layer`."""
        home = self.cfg.device
        total = torch.zeros(self.cfg.d_model, device=home, dtype=self.cfg.dtype)
        for l in range(layer):
            total = total + self.blocks[l].attn.b_O.to(home)
            if include_mlp_biases:
                total = total + self.blocks[l].mlp.b_out.to(home)
        if mlp_input:
            total = total + self.blocks[layer].attn.b_O.to(home)
        return total

    # ------------------------------------------------------------------ TransformerLens conveniences
    @checked_arguments(flags=("use_attn_result",))
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute per-head outputs (hook_result) in the forward; slower, needed to hook them."""
        self.cfg.use_attn_result = use_attn_result

    @checked_arguments(flags=("use_split_qkv_input",))
    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """TransformerLens's split inputs: each head reads its own copy of resid_pre, hooked before `ln1` as
        `blocks.{l}.attn.hook_q_input` [batch, pos, n_heads, d_model] and `hook_k_input` / `hook_v_input`
        [batch, pos, n_key_value_heads, d_model] (per kv head under grouped-query attention, as
        TransformerLens's grouped-query attention and its 4.x bridge). Rewards are unchanged; patching one
        head's slot changes that head's query (or that kv head's keys / values) only."""
        self._set_exclusive("use_split_qkv_input", use_split_qkv_input, "use_attn_in")

    @checked_arguments(flags=("use_attn_in",))
    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """`blocks.{l}.attn.hook_attn_in` [batch, pos, n_heads, d_model]: resid_pre copied per query head,
        before `ln1` (TransformerLens). Under grouped-query attention kv head j reads slot j (as
        TransformerLens 4.x's bridge)."""
        self._set_exclusive("use_attn_in", use_attn_in, "use_split_qkv_input")

    def _set_exclusive(self, name: str, value: bool, other: str) -> None:
        """Set the config flag `name`, refused while the flag `other` it excludes is on."""
        if value and getattr(self.cfg, other):
            raise ValueError(
                f"{name} and {other} are exclusive (as in TransformerLens): call "
                f"model.set_{other}(False) first"
            )
        setattr(self.cfg, name, value)

    @checked_arguments(flags=("use_hook_mlp_in",))
    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """`blocks.{l}.hook_mlp_in` [batch, pos, d_model]: the MLP branch's input before `ln2` (resid_mid),
        as in TransformerLens."""
        self.cfg.use_hook_mlp_in = use_hook_mlp_in

    @property
    def W_E(self) -> torch.Tensor:
        return self.embed.W_E

    W_Q = stacked_weight("attn.W_Q", "[layer, head, d_model, d_head]")
    W_O = stacked_weight("attn.W_O", "[layer, head, d_head, d_model]")
    W_in = stacked_weight("mlp.W_in", "[layer, d_model, d_mlp]")
    W_gate = stacked_weight("mlp.W_gate", "[layer, d_model, d_mlp]")
    W_out = stacked_weight("mlp.W_out", "[layer, d_mlp, d_model]")
