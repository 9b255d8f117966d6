"""HookedRewardModel: a TransformerLens-style decoder whose unembed is a reward head.

    resid = hook_embed(W_E[ids])
    for block in blocks: resid = resid + attn_out + mlp_out      (pre-norm blocks, hooks on every term)
    reward = reward_head(ln_final(resid), readout)               (readout = rightmost non-pad token)

Built on TransformerLens's kept infrastructure (HookedRootModule, HookPoint, ActivationCache), so
`run_with_cache`, `run_with_hooks` and `transformer_lens.patching` work on it unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from reward_lens.model.components import Embed, RMSNorm, RotaryEmbedding, TransformerBlock, attention_masks
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.scalar import build_head, last_position_without_pad

# Activations whose position axis is not dim 1 (attention scores/patterns: [batch, head, query, key]).
QUERY_AXIS_2_HOOKS = ("hook_attn_scores", "hook_pattern")


class HookedRewardModel(HookedRootModule):
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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path_or_id: Union[str, Path],
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        generic: bool = False,
        **kwargs: Any,
    ) -> "HookedRewardModel":
        """Load an HF reward checkpoint (local dir or hub id) or a saved hooked checkpoint.

        An architecture without a native weight map (or `generic=True`) loads on the generic
        component-level path (`reward_lens.model.generic.wrapper.GenericHookedRewardModel`; option `module_map=`).
        `gguf_file="x.gguf"` loads a llama.cpp file in `path_or_id` as transformers does (dequantised to float32;
        needs `pip install gguf`); a GGUF holds no reward head, so the score head is random until set
        (`reward_lens.model.gguf`). Other keyword arguments override config fields (e.g. `pad_token_id`).
        """
        from reward_lens.model.loading import load_pretrained

        return load_pretrained(cls, path_or_id, device=device, dtype=dtype, fold_ln=fold_ln, generic=generic, **kwargs)

    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        generic: bool = False,
        module_map: Optional[Dict[str, Optional[str]]] = None,
    ) -> "HookedRewardModel":
        """Convert a transformers model already in memory (its weights are copied, not shared).

        No native weight map (or `generic=True`): a copy wrapped on the generic component-level path.
        """
        import copy

        from reward_lens.model.loading import convert_state_dict, has_native_weight_map

        config = copy.deepcopy(hf_model.config)
        if not getattr(config, "architectures", None):  # set by save_pretrained, absent in memory
            config.architectures = [type(hf_model).__name__]
        if generic or module_map is not None or not has_native_weight_map(config):
            from reward_lens.model.generic.wrapper import GenericHookedRewardModel

            return GenericHookedRewardModel.from_hf_model(
                hf_model, tokenizer, device=device, dtype=dtype, fold_ln=fold_ln, module_map=module_map
            )
        return convert_state_dict(
            cls, config, hf_model.state_dict(), tokenizer=tokenizer,
            device=device, dtype=dtype, fold_ln=fold_ln,
        )

    def save_pretrained(self, path: Union[str, Path]) -> None:
        """Save as a hooked checkpoint (config JSON + safetensors + tokenizer files)."""
        from reward_lens.model.loading import save_hooked

        save_hooked(self, path)

    # ------------------------------------------------------------------ forward
    def readout_positions(
        self, input_ids: Optional[Int[torch.Tensor, "batch pos"]], attention_mask: Optional[torch.Tensor] = None
    ) -> Int[torch.Tensor, "batch"]:
        """Where the reward is read, exactly as transformers pools: the rightmost non-pad token.

        Without input ids (a forward started from a residual), the rightmost attended position.
        A head with its own published rule (ArmoRM's `(argmax(ids == pad) - 1) mod T`) overrides this.
        """
        head_readout = getattr(self.reward_head, "readout_positions", None)
        if head_readout is not None and input_ids is not None:
            return head_readout(input_ids, attention_mask)
        if input_ids is None:
            if attention_mask is None:
                raise ValueError("readout_positions needs input_ids or attention_mask")
            idx = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
            return (idx * attention_mask.long()).argmax(-1)
        pad = self.cfg.pad_token_id
        if pad is None:
            return last_position_without_pad(input_ids)
        idx = torch.arange(input_ids.shape[1], device=input_ids.device)
        return (idx * (input_ids != pad).long()).argmax(-1)

    def forward(
        self,
        input: Union[Int[torch.Tensor, "batch pos"], Float[torch.Tensor, "batch pos d_model"]],
        attention_mask: Optional[Int[torch.Tensor, "batch pos"]] = None,
        position_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        *,
        input_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        readout_positions: Optional[Int[torch.Tensor, "batch"]] = None,
    ) -> torch.Tensor:
        """Rewards [batch] (or [batch, n_outputs]); the residual before block `stop_at_layer` if given.

        With `start_at_layer=l`, `input` is the residual entering block l; pass `input_ids` too (or
        `readout_positions`) so the readout is found as in a full run.
        Position ids default to the count of attended tokens before each position, so a left-padded
        sequence gets the same reward as the unpadded one.
        """
        if start_at_layer is None:
            input_ids = input
            residual = self.hook_embed(self.embed(input.to(self.cfg.device)))
            start_at_layer = 0
        else:
            residual = input
        batch, T = residual.shape[:2]
        device = residual.device
        if attention_mask is None:
            attention_mask = torch.ones(batch, T, dtype=torch.long, device=device)
        attention_mask = attention_mask.to(device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        cos, sin = self.rotary(position_ids.to(device), residual.dtype)
        masks = attention_masks(attention_mask, self.cfg.window_sizes)
        stop = self.cfg.n_layers if stop_at_layer is None else stop_at_layer
        for block in self.blocks[start_at_layer:stop]:
            residual = block(residual, cos, sin, masks[block.attn.window])
        if stop_at_layer is not None:
            return residual
        if readout_positions is None:
            readout_positions = self.readout_positions(input_ids, attention_mask)
        return self.reward_head(self.ln_final(residual), readout_positions, input_ids=input_ids)

    def run_with_cache(self, *model_args: Any, readout_only: bool = False, **kwargs: Any):
        """`HookedRootModule.run_with_cache`, returning a `transformer_lens.ActivationCache`.

        `readout_only=True` keeps only each sequence's readout position (position axis of length 1),
        so a long input's cache costs O(layers x d_model) per sequence.
        """
        if readout_only:
            return self._run_with_readout_cache(*model_args, **kwargs)
        out, cache_dict = super().run_with_cache(*model_args, **kwargs)
        return out, ActivationCache(cache_dict, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def _run_with_readout_cache(self, input, attention_mask=None, *, names_filter=None, device=None, **kwargs):
        ids = kwargs.get("input_ids", input if kwargs.get("start_at_layer") is None else None)
        readout = kwargs.pop("readout_positions", None)
        if readout is None:
            readout = self.readout_positions(ids, attention_mask)
        names = self._filter_names(names_filter)
        cache: Dict[str, torch.Tensor] = {}

        def keep(tensor: torch.Tensor, hook: HookPoint):
            if tensor.dim() >= 3 and hook.name.endswith(QUERY_AXIS_2_HOOKS):
                kept = tensor[torch.arange(tensor.shape[0]), :, readout.to(tensor.device)][:, :, None]
            elif tensor.dim() >= 3:
                kept = tensor[torch.arange(tensor.shape[0]), readout.to(tensor.device)][:, None]
            else:
                kept = tensor
            cache[hook.name] = kept.detach().to(device) if device is not None else kept.detach()

        out = self.run_with_hooks(
            input, attention_mask, readout_positions=readout, fwd_hooks=[(n, keep) for n in names], **kwargs
        )
        return out, ActivationCache(cache, self)

    def _filter_names(self, names_filter) -> List[str]:
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return [names_filter]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        return list(names_filter)

    # ------------------------------------------------------------------ reward direction
    @property
    def reward_direction(self) -> Float[torch.Tensor, "d_model"]:
        """w such that reward = w . (resid_final[readout] / ln_final.hook_scale) + reward_bias."""
        return self.reward_direction_of(0)

    def reward_direction_of(self, output: int = 0) -> Float[torch.Tensor, "d_model"]:
        if self.cfg.n_outputs > 1 and output is None:
            raise ValueError("this head has several outputs; pass output=<index>")
        direction = self.reward_head.direction(output)
        if self.ln_final.w is not None:
            direction = direction * (self.cfg.norm_weight_offset + self.ln_final.w)
        return direction

    def reward_direction_for(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, "batch d_model"]:
        """Per-sequence w such that reward[b] = w[b] . (resid_final[b, readout] / ln_final.hook_scale) + reward_bias.

        For a linear head every row is `reward_direction`; for ArmoRM it is the prompt-conditioned
        W_reg T g(prompt) (one forward pass to compute the gate).
        """
        head = self.reward_head
        if hasattr(head, "direction_for"):
            direction = head.direction_for(self, input_ids, attention_mask)
        else:
            direction = head.direction(0).expand(input_ids.shape[0], -1)
        if self.ln_final.w is not None:
            direction = direction * (self.cfg.norm_weight_offset + self.ln_final.w)
        return direction

    @property
    def reward_bias(self) -> torch.Tensor:
        return self.reward_head.bias(0)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        """Sum of the attention and MLP output biases written into the residual before `layer`."""
        total = torch.zeros(self.cfg.d_model, device=self.cfg.device, dtype=self.cfg.dtype)
        for l in range(layer):
            total = total + self.blocks[l].attn.b_O
            if include_mlp_biases:
                total = total + self.blocks[l].mlp.b_out
        if mlp_input:
            total = total + self.blocks[layer].attn.b_O
        return total

    # ------------------------------------------------------------------ TransformerLens conveniences
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Compute per-head outputs (hook_result) in the forward; slower, needed to hook them."""
        self.cfg.use_attn_result = use_attn_result

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        if use_split_qkv_input:
            raise NotImplementedError("per-head split q/k/v inputs are not implemented in reward-lens")

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        self.cfg.use_attn_in = use_attn_in

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        self.cfg.use_hook_mlp_in = use_hook_mlp_in

    def _stack(self, getter: Callable[[TransformerBlock], torch.Tensor]) -> torch.Tensor:
        return torch.stack([getter(block) for block in self.blocks], dim=0)

    @property
    def W_E(self) -> torch.Tensor:
        return self.embed.W_E

    @property
    def W_Q(self) -> torch.Tensor:
        return self._stack(lambda b: b.attn.W_Q)

    @property
    def W_K(self) -> torch.Tensor:
        return self._stack(lambda b: b.attn.W_K)

    @property
    def W_V(self) -> torch.Tensor:
        return self._stack(lambda b: b.attn.W_V)

    @property
    def W_O(self) -> torch.Tensor:
        return self._stack(lambda b: b.attn.W_O)

    @property
    def W_in(self) -> torch.Tensor:
        return self._stack(lambda b: b.mlp.W_in)

    @property
    def W_gate(self) -> torch.Tensor:
        return self._stack(lambda b: b.mlp.W_gate)

    @property
    def W_out(self) -> torch.Tensor:
        return self._stack(lambda b: b.mlp.W_out)

    # ------------------------------------------------------------------ device / dtype
    def to(self, *args: Any, **kwargs: Any) -> "HookedRewardModel":
        out = super().to(*args, **kwargs)
        param = next(self.parameters())
        self.cfg.device = param.device
        self.cfg.dtype = param.dtype
        return out

    def cuda(self, device: Any = None) -> "HookedRewardModel":
        return self.to(device if device is not None else "cuda")

    def cpu(self) -> "HookedRewardModel":
        return self.to("cpu")

    # ------------------------------------------------------------------ tokenisation
    def to_tokens(
        self,
        prompts: Union[str, Sequence[str]],
        responses: Union[str, Sequence[str]],
        *,
        padding_side: Optional[str] = None,
        max_length: Optional[int] = None,
    ) -> Dict[str, torch.Tensor]:
        """Tokenise (prompt, response) pairs as the reward model expects; see `reward_lens.model.tokenization`."""
        from reward_lens.model.tokenization import tokenize_pairs

        return tokenize_pairs(self, prompts, responses, padding_side=padding_side, max_length=max_length)
