"""Generative judges: a causal language model read as a reward model (`HookedRewardModel.from_judge`).

The reward is logit(positive) - logit(negative) at the last position, exactly linear in the final-norm
output with direction W_U[positive] - W_U[negative] (see `reward_lens.model.heads.judge`). The weight map
is built per judge (the answer tokens are part of it): the base family's decoder map (by `model_type`),
and the head from the unembedding rows

  lm_head.weight [V, d] (or model.embed_tokens.weight when the embeddings are tied / lm_head is absent)
      -> reward_head.W_R [d, 1] = (W_U[positive] - W_U[negative])[:, None]
  lm_head.bias (if any) -> reward_head.b_R = b_U[positive] - b_U[negative]

A language model whose logits are not a linear map of the final norm's output (Gemma-2's
`final_logit_softcapping`) is refused: its logit difference has no exact linear decomposition.
"""

from __future__ import annotations

from typing import Any

import torch

import reward_lens.model.heads.judge  # noqa: F401  (registers the "judge" head type)
from reward_lens.converters.llama import convert_decoder_rest, rope_inverse_frequencies
from reward_lens.converters.openrlhf import base_weight_map
from reward_lens.converters.registry import StateDict, WeightMap
from reward_lens.model.config import RewardModelConfig


def judge_weight_map(
    hf_config: Any, positive: str, negative: str, positive_id: int, negative_id: int
) -> WeightMap:
    """The weight map of a judge on `hf_config`'s causal LM reading positive_id minus negative_id."""
    text = hf_config.get_text_config()
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        raise ValueError(
            f"config field final_logit_softcapping={cap} is not supported: this language model's logits "
            "are soft-capped, so a logit difference is not linear in the final residual; supported: "
            "judges without final_logit_softcapping"
        )
    base = base_weight_map(hf_config)
    vocab = int(text.vocab_size)
    for name, tid in (("positive", positive_id), ("negative", negative_id)):
        if not 0 <= tid < vocab:
            raise ValueError(f"{name} token id {tid} is outside the model's vocabulary of {vocab}")

    def build_config(c: Any) -> RewardModelConfig:
        cfg = base.build_config(c)
        cfg.head_type, cfg.n_outputs, cfg.readout = "judge", 1, "last_attended"
        cfg.head_config = dict(
            positive=positive, negative=negative, positive_id=int(positive_id), negative_id=int(negative_id)
        )
        cfg.original_architecture = (c.architectures or ["?"])[0]
        return cfg

    def convert_rest(sd: StateDict, cfg: RewardModelConfig, c: Any) -> StateDict:
        tied = bool(getattr(text, "tie_word_embeddings", False))
        if "lm_head.weight" not in sd and not tied:
            raise ValueError(
                "this checkpoint has no lm_head.weight and does not tie its embeddings "
                "(tie_word_embeddings is false), so it has no language-model head to read answer logits "
                "from (a base model or a classifier); load the causal LM checkpoint (...ForCausalLM)"
            )
        key = "lm_head.weight" if "lm_head.weight" in sd and not tied else "model.embed_tokens.weight"
        W_U = sd[key]
        out = {**convert_decoder_rest(sd, cfg), "rotary.inv_freq": rope_inverse_frequencies(text)[0]}
        diff_U = W_U[positive_id].double() - W_U[negative_id].double()
        out["reward_head.W_R"] = diff_U.to(W_U.dtype)[:, None]
        b_U = sd.get("lm_head.bias")
        no_bias = torch.zeros(1, dtype=W_U.dtype)
        out["reward_head.b_R"] = no_bias if b_U is None else (b_U[positive_id] - b_U[negative_id]).reshape(1)
        return out

    return WeightMap(
        f"judge({cfg_name(hf_config)})",
        build_config,
        base.convert_layer,
        convert_rest,
        notes="causal LM read as a judge: logit(positive) - logit(negative), last position",
    )


def cfg_name(hf_config: Any) -> str:
    return (getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])[0]
