"""The config dataclass: the single source of shapes and architecture switches.

Field names follow TransformerLens's HookedTransformerConfig so that TransformerLens tools
(`ActivationCache`, `transformer_lens.patching`) that read `model.cfg` work unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class RewardModelConfig:
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int = 4096
    n_key_value_heads: Optional[int] = None
    act_fn: str = "silu"
    normalization_type: str = "RMS"  # "RMS" (weights kept) or "RMSPre" (weights folded away)
    eps: float = 1e-6
    positional_embedding_type: str = "rotary"
    rotary_dim: Optional[int] = None
    rotary_attention_scaling: float = 1.0  # cos/sin multiplier of yarn/longrope-style RoPE
    original_architecture: str = "LlamaForSequenceClassification"
    # Architecture quirks (all off for Llama).
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    attn_scale: Optional[float] = None  # scores are divided by this; default sqrt(d_head)
    attn_scores_soft_cap: Optional[float] = None  # Gemma-2: cap * tanh(scores / cap)
    window_sizes: Optional[List[Optional[int]]] = None  # per layer: None = full causal attention
    post_norms: bool = False  # Gemma-2: norms on attention/MLP outputs before the residual add
    norm_weight_offset: float = 0.0  # Gemma: the norm multiplies by (offset + w)
    embed_scale: Optional[float] = None  # Gemma: embeddings multiplied by sqrt(d_model)
    # Reward head.
    n_outputs: int = 1
    head_type: str = "scalar"  # "scalar" or "armorm"
    head_config: Dict[str, Any] = field(default_factory=dict)
    pad_token_id: Optional[int] = None
    # Where the reward is read (reward_lens.model.readout.READOUT_RULES) and the text format the RM was
    # trained on.
    readout: str = "last_non_pad"
    input_format: Optional[str] = None
    # Runtime switches, named as in TransformerLens.
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_attn_in: bool = False
    use_hook_mlp_in: bool = False
    device: Any = "cpu"
    dtype: torch.dtype = torch.float32
    model_name: str = "reward-model"

    def __post_init__(self) -> None:
        if self.n_key_value_heads is None:
            self.n_key_value_heads = self.n_heads
        if self.rotary_dim is None:
            self.rotary_dim = self.d_head
        if self.attn_scale is None:
            self.attn_scale = self.d_head**0.5
        if self.window_sizes is None:
            self.window_sizes = [None] * self.n_layers
        if len(self.window_sizes) != self.n_layers:
            raise ValueError(
                f"window_sizes has {len(self.window_sizes)} entries for {self.n_layers} layers; give one "
                "per layer"
            )
        if self.n_heads % self.n_key_value_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_key_value_heads={self.n_key_value_heads}"
            )

    @property
    def attn_only(self) -> bool:
        """Always False (every block has an MLP); read by TransformerLens's ActivationCache."""
        return False

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).replace("torch.", "")
        out["device"] = str(self.device)
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RewardModelConfig":
        d = dict(d)
        if isinstance(d.get("dtype"), str):
            d["dtype"] = getattr(torch, d["dtype"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(
                f"unknown config fields {sorted(unknown)}; was this checkpoint saved by a newer reward-lens?"
            )
        return cls(**d)
