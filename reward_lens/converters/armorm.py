"""ArmoRM (`LlamaForRewardModelWithGating`, RLHFlow/ArmoRM-Llama3-8B-v0.1), loaded without remote code.

The checkpoint's own modelling file needs `trust_remote_code`; this map stands in for it (the loader
drops `auto_map` and never executes checkpoint code). config.json is a Llama config plus
`num_objectives`, `gating_temperature`, `gating_hidden_dim`, `gating_n_hidden` (defaults 19, 10, 1024,
3 as the published code) and optionally our `gating_token_pattern` (default: Llama-3's assistant
header, see `reward_lens.model.heads.armorm.DEFAULT_GATING_PATTERN`).

transformers layout -> ours:
  model.*                              -> the Llama decoder map (layer by layer)
  regression_layer.weight [n_obj, d]   -> reward_head.W_reg [d, n_obj]   (no bias)
  reward_transform_matrix [n_obj, n_obj] -> reward_head.reward_transform
  gating.layers.i.weight [out, in]     -> reward_head.W_gate.i [in, out]; .bias -> reward_head.b_gate.i
  gating.logit_scale [1]               -> reward_head.logit_scale
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch

import reward_lens.model.heads.armorm  # noqa: F401  (registers the "armorm" head type)
from reward_lens.converters.llama import (
    convert_decoder_rest,
    convert_llama_layer,
    decoder_config,
    rope_inverse_frequencies,
)
from reward_lens.converters.registry import StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.armorm import DEFAULT_GATING_PATTERN, default_objective_names


def gating_head_config(hf_config: Any, **head_fields: Any) -> Dict[str, Any]:
    """The head config of the gated Llama heads (ArmoRM's; QRM's adds `head_fields`, e.g. num_quantiles,
    after num_objectives), the authors' defaults where config.json has no value."""
    n_obj = int(getattr(hf_config, "num_objectives", 19))
    return dict(
        num_objectives=n_obj,
        **head_fields,
        gating_temperature=float(getattr(hf_config, "gating_temperature", 10)),
        gating_hidden_dim=int(getattr(hf_config, "gating_hidden_dim", 1024)),
        gating_n_hidden=int(getattr(hf_config, "gating_n_hidden", 3)),
        gating_pattern=[
            int(t) for t in (getattr(hf_config, "gating_token_pattern", None) or DEFAULT_GATING_PATTERN)
        ],
        objective_names=list(getattr(hf_config, "objective_names", None) or default_objective_names(n_obj)),
    )


def gated_rest(
    sd: StateDict,
    cfg: RewardModelConfig,
    hf_config: Any,
    checkpoint: str,
    regression: Callable[[StateDict], torch.Tensor],
) -> StateDict:
    """The decoder's non-layer tensors and the ones ArmoRM's and QRM's heads share: the regression layer
    (`regression` reads its [out, d_model] weight, checked as the head needs), the transform matrix and
    the logit scale. A missing one: refused as not `checkpoint` (e.g. "an ArmoRM checkpoint")."""
    required = ("regression_layer.weight", "reward_transform_matrix", "gating.logit_scale")
    missing = [k for k in required if k not in sd]
    if missing:
        raise ValueError(f"not {checkpoint}: tensors {missing} are missing")
    out = convert_decoder_rest(sd, cfg)
    out["rotary.inv_freq"] = rope_inverse_frequencies(hf_config.get_text_config())[0]
    out["reward_head.W_reg"] = regression(sd).T
    out["reward_head.reward_transform"] = sd["reward_transform_matrix"]
    out["reward_head.logit_scale"] = sd["gating.logit_scale"].reshape(1)
    return out


def armorm_config(hf_config: Any) -> RewardModelConfig:
    head_config = gating_head_config(hf_config)
    # n_outputs = 1: the model's output is the gated score (num_labels in the config is meaningless here).
    return decoder_config(hf_config, head_type="armorm", n_outputs=1, head_config=head_config)


def convert_armorm_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    hc = cfg.head_config
    n_obj, n_hidden, hidden = hc["num_objectives"], hc["gating_n_hidden"], hc["gating_hidden_dim"]
    out = gated_rest(sd, cfg, hf_config, "an ArmoRM checkpoint", lambda sd: sd["regression_layer.weight"])
    dims = [cfg.d_model] + [hidden] * n_hidden + [n_obj]
    for i in range(n_hidden + 1):
        W = sd.get(f"gating.layers.{i}.weight")
        if W is None or tuple(W.shape) != (dims[i + 1], dims[i]):
            raise ValueError(
                f"gating.layers.{i}.weight has shape {None if W is None else tuple(W.shape)}, expected "
                f"{(dims[i + 1], dims[i])} from config (gating_n_hidden={n_hidden}, "
                f"gating_hidden_dim={hidden}, num_objectives={n_obj}); fix those config fields to match "
                "the checkpoint"
            )
        out[f"reward_head.W_gate.{i}"] = W.T
        out[f"reward_head.b_gate.{i}"] = sd[f"gating.layers.{i}.bias"]
    if f"gating.layers.{n_hidden + 1}.weight" in sd:
        raise ValueError(
            f"the checkpoint has more than gating_n_hidden + 1 = {n_hidden + 1} gate layers; set "
            "gating_n_hidden in config.json to the number of hidden gate layers"
        )
    return out


ARMORM = register(
    WeightMap(
        architecture="LlamaForRewardModelWithGating",
        build_config=armorm_config,
        convert_layer=convert_llama_layer,
        convert_rest=convert_armorm_rest,
        notes="Llama decoder + ArmoRM head (19 objectives, transform matrix, MLP gate at the last "
        "assistant header); no remote code. Readout (argmax(ids == pad) - 1) mod T.",
    )
)
