"""Llama (`LlamaForSequenceClassification`): the reference decoder map the other families reuse.

transformers layout -> ours:
  model.embed_tokens.weight [V, d]              -> embed.W_E
  model.layers.l.input_layernorm.weight         -> blocks.l.ln1.w
  model.layers.l.self_attn.{q,k,v}_proj.weight  -> blocks.l.attn.W_{Q,K,V} [n, d, h] (bias -> b_*)
  model.layers.l.self_attn.o_proj.weight        -> blocks.l.attn.W_O [n, h, d]
  model.layers.l.post_attention_layernorm.weight-> blocks.l.ln2.w
  model.layers.l.mlp.{gate,up,down}_proj.weight -> blocks.l.mlp.W_{gate,in,out}
  model.norm.weight                             -> ln_final.w
  score.weight [n_out, d] (+ bias)              -> reward_head.W_R [d, n_out] (+ b_R)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from reward_lens.converters.openrlhf import missing_head_error
from reward_lens.converters.registry import StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig


def rope_inverse_frequencies(hf_config: Any):
    """(inv_freq, attention_scaling) from transformers' own RoPE initialisers (llama3, yarn, linear, ...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"unsupported rope_type {rope_type!r}; transformers knows {sorted(ROPE_INIT_FUNCTIONS)}"
            )
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=None)
        return inv_freq.float(), float(scaling)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, 1.0


def decoder_config(hf_config: Any, **overrides: Any) -> RewardModelConfig:
    """The config fields every Llama-like decoder shares; architectures pass their quirks as overrides."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    n_heads = text.num_attention_heads
    d_head = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    inv_freq, scaling = rope_inverse_frequencies(text)
    fields = dict(
        n_layers=text.num_hidden_layers,
        d_model=text.hidden_size,
        n_heads=n_heads,
        d_head=d_head,
        n_key_value_heads=getattr(text, "num_key_value_heads", None) or n_heads,
        d_mlp=text.intermediate_size,
        d_vocab=text.vocab_size,
        n_ctx=getattr(text, "max_position_embeddings", 4096),
        act_fn=getattr(text, "hidden_act", "silu"),
        eps=getattr(text, "rms_norm_eps", 1e-6),
        rotary_dim=2 * inv_freq.shape[0],
        rotary_attention_scaling=scaling,
        original_architecture=(hf_config.architectures or ["?"])[0],
        n_outputs=getattr(hf_config, "num_labels", 1),
        pad_token_id=getattr(text, "pad_token_id", None),
        model_name=getattr(hf_config, "_name_or_path", "") or "reward-model",
    )
    fields.update(overrides)
    return RewardModelConfig(**fields)


def layer_windows(hf_config: Any) -> list:
    """Per-layer sliding windows from transformers' `layer_types` (Qwen2/Qwen3/Gemma-2 style)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    return [window if t == "sliding_attention" and window else None for t in types]


def _head_major(w: torch.Tensor, n: int, h: int) -> torch.Tensor:
    """[n*h, d] projection weight -> [n, d, h] view whose storage stays [n, h, d] (see components)."""
    return w.view(n, h, -1).transpose(1, 2)


def convert_decoder_rest(sd: StateDict, cfg: RewardModelConfig, prefix: str = "model.") -> StateDict:
    """A Llama-like decoder's weights outside its layers: the embedding and the final norm."""
    return {"embed.W_E": sd[f"{prefix}embed_tokens.weight"], "ln_final.w": sd[f"{prefix}norm.weight"]}


def convert_decoder_layer(sd: StateDict, cfg: RewardModelConfig, l: int, prefix: str = "model.") -> StateDict:
    """Map layer `l` of a Llama-like decoder; optional pieces (qkv biases, q/k norms) are taken when present.
    Reads only that layer's tensors, so a lazy `sd` loads one layer at a time."""
    n, nkv, h, d = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model
    out: StateDict = {}
    src, dst = f"{prefix}layers.{l}.", f"blocks.{l}."
    att = src + "self_attn."
    out[dst + "ln1.w"] = sd[src + "input_layernorm.weight"]
    out[dst + "ln2.w"] = sd[src + "post_attention_layernorm.weight"]
    for name, heads in (("q", n), ("k", nkv), ("v", nkv)):
        W = name.upper()
        out[dst + f"attn.W_{W}"] = _head_major(sd[att + f"{name}_proj.weight"], heads, h)
        bias = sd.get(att + f"{name}_proj.bias")
        out[dst + f"attn.b_{W}"] = bias.view(heads, h) if bias is not None else torch.zeros(heads, h)
    out[dst + "attn.W_O"] = sd[att + "o_proj.weight"].T.reshape(n, h, d)
    o_bias = sd.get(att + "o_proj.bias")
    out[dst + "attn.b_O"] = o_bias if o_bias is not None else torch.zeros(d)
    if cfg.qk_norm:
        out[dst + "attn.q_norm.w"] = sd[att + "q_norm.weight"]
        out[dst + "attn.k_norm.w"] = sd[att + "k_norm.weight"]
    mlp = src + "mlp."
    out[dst + "mlp.W_gate"] = sd[mlp + "gate_proj.weight"].T
    out[dst + "mlp.W_in"] = sd[mlp + "up_proj.weight"].T
    out[dst + "mlp.W_out"] = sd[mlp + "down_proj.weight"].T
    if mlp + "gate_proj.bias" in sd:
        raise ValueError("MLP gate biases (mlp_bias=True) are not supported by the hooked GatedMLP yet")
    out[dst + "mlp.b_in"] = sd.get(mlp + "up_proj.bias", torch.zeros(cfg.d_mlp))
    out[dst + "mlp.b_out"] = sd.get(mlp + "down_proj.bias", torch.zeros(d))
    return out


def convert_score_head(sd: StateDict, cfg: RewardModelConfig, key: str = "score") -> StateDict:
    if f"{key}.weight" not in sd:
        raise missing_head_error(sd, key, cfg.original_architecture)
    weight = sd[f"{key}.weight"]
    if weight.shape[0] != cfg.n_outputs:
        raise ValueError(
            f"{key}.weight has {weight.shape[0]} output row(s) but config.json says "
            f"num_labels={cfg.n_outputs} "
            f'(transformers\' default is 2 when config.json has none); set "num_labels": {weight.shape[0]} '
            "in config.json"
        )
    bias: Optional[torch.Tensor] = sd.get(f"{key}.bias")
    return {
        "reward_head.W_R": weight.T,
        "reward_head.b_R": bias if bias is not None else torch.zeros(weight.shape[0]),
    }


def convert_llama_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    inv_freq = rope_inverse_frequencies(hf_config.get_text_config())[0]
    return {**convert_decoder_rest(sd, cfg), **convert_score_head(sd, cfg), "rotary.inv_freq": inv_freq}


def convert_llama_layer(sd: StateDict, cfg: RewardModelConfig, hf_config: Any, l: int) -> StateDict:
    return convert_decoder_layer(sd, cfg, l)


LLAMA = register(
    WeightMap(
        architecture="LlamaForSequenceClassification",
        build_config=lambda c: decoder_config(c),
        convert_layer=convert_llama_layer,
        convert_rest=convert_llama_rest,
        notes="RoPE incl. llama3 scaling (transformers' initialisers), GQA, SwiGLU, RMSNorm.",
    )
)
