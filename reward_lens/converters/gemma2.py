"""Gemma-2 (`Gemma2ForSequenceClassification`, e.g. Skywork-Reward-Gemma-2-27B): every quirk kept.

Checked against transformers 5.24's `models/gemma2/modeling_gemma2.py`:
  * RMSNorm gain is (1 + w), computed in float32 then cast        -> cfg.norm_weight_offset = 1
  * embeddings times sqrt(d_model), the scale rounded to the dtype -> cfg.embed_scale
  * four norms per layer; the residual receives the *post-normed* attention / MLP output, so
    hook_attn_out / hook_mlp_out are post-norm outputs and the decomposition is exact over them
  * scores scaled by query_pre_attn_scalar**-0.5, not head_dim     -> cfg.attn_scale
  * attention logits soft-capped, cap * tanh(s / cap), before masking -> cfg.attn_scores_soft_cap
  * sliding window on the layers `layer_types` marks "sliding_attention" (key > query - window)
  * GeGLU with `hidden_activation` (gelu_pytorch_tanh), no biases
  * the sequence-classification head is transformers' GenericForSequenceClassification: a plain
    `score` Linear pooled at the rightmost non-pad token. `final_logit_softcapping` is applied only by
    Gemma2ForCausalLM, never to the reward, so it is (correctly) not applied here either.

transformers names -> ours (the Llama map, then the norms renamed):
  input_layernorm -> ln1, post_attention_layernorm -> ln1_post,
  pre_feedforward_layernorm -> ln2, post_feedforward_layernorm -> ln2_post.
"""

from __future__ import annotations

from typing import Any

from reward_lens.converters.llama import (
    convert_llama_layer,
    convert_llama_rest,
    decoder_config,
    layer_windows,
)
from reward_lens.converters.registry import StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig


def gemma2_config(hf_config: Any) -> RewardModelConfig:
    text = hf_config.get_text_config()
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(
            "this Gemma-2 config sets use_bidirectional_attention=True, which reward-lens does not "
            "implement (its attention is causal); convert a causal Gemma-2 reward model"
        )
    return decoder_config(
        hf_config,
        act_fn=getattr(text, "hidden_activation", None) or "gelu_pytorch_tanh",
        attn_scale=float(text.query_pre_attn_scalar) ** 0.5,
        attn_scores_soft_cap=getattr(text, "attn_logit_softcapping", None),
        window_sizes=layer_windows(text),
        post_norms=True,
        norm_weight_offset=1.0,
        embed_scale=float(text.hidden_size) ** 0.5,
    )


def convert_gemma2_layer(sd: StateDict, cfg: RewardModelConfig, hf_config: Any, l: int) -> StateDict:
    out = convert_llama_layer(sd, cfg, hf_config, l)  # maps post_attention_layernorm to ln2; fixed below
    src, dst = f"model.layers.{l}.", f"blocks.{l}."
    out[dst + "ln1_post.w"] = sd[src + "post_attention_layernorm.weight"]
    out[dst + "ln2.w"] = sd[src + "pre_feedforward_layernorm.weight"]
    out[dst + "ln2_post.w"] = sd[src + "post_feedforward_layernorm.weight"]
    return out


GEMMA2 = register(
    WeightMap(
        architecture="Gemma2ForSequenceClassification",
        build_config=gemma2_config,
        convert_layer=convert_gemma2_layer,
        convert_rest=convert_llama_rest,
        notes="(1+w) RMSNorm, sqrt(d) embed scale, pre+post norms, query_pre_attn_scalar, attention "
        "soft-cap, per-layer sliding windows, GeGLU (tanh GELU); no final-logit soft-cap on the reward "
        "(as transformers).",
    )
)
