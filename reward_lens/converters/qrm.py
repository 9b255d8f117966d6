"""QRM (`LlamaForRewardModelWithGating31`, `LlamaForRewardModelWithGating3`; nicolinho/QRM-Llama3.1-8B,
QRM-Llama3-8B), loaded without remote code (the loader drops `auto_map`).

config.json: a Llama config plus `num_objectives` (19), `num_quantiles`, `gating_temperature` (10),
`gating_hidden_dim` (1024), `gating_n_hidden` (3) (the authors' defaults in brackets), optionally our
`gating_token_pattern` (default: Llama-3's assistant header, as the authors hard-code).

transformers layout -> ours (`reward_lens.model.heads.qrm`):
  model.*                                    -> the Llama decoder map
  regression_layer.weight [n_obj * n_q, d]   -> reward_head.W_reg [d, n_obj * n_q]   (no bias)
  reward_transform_matrix [n_obj, n_obj]     -> reward_head.reward_transform
  gating.layers.{3i}.weight [out, in]        -> reward_head.W_gate.i [in, out]        (hidden Linear, no bias)
  gating.layers.{3i+2}.{weight,bias}         -> reward_head.bn_weight.i, bn_bias.i  (BatchNorm1d, eval mode:
  gating.layers.{3i+2}.running_{mean,var}    -> reward_head.bn_mean_i, bn_var_i      running statistics)
  gating.layers.{3n}.{weight,bias}           -> reward_head.W_gate.n, b_gate          (output Linear)
  gating.logit_scale [1]                     -> reward_head.logit_scale
"""

from __future__ import annotations

from typing import Any

import reward_lens.model.heads.qrm  # noqa: F401  (registers the "qrm" head type)
from reward_lens.converters.armorm import gated_rest, gating_head_config
from reward_lens.converters.llama import convert_llama_layer, decoder_config
from reward_lens.converters.registry import StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig


def qrm_config(hf_config: Any) -> RewardModelConfig:
    n_q = getattr(hf_config, "num_quantiles", None)
    if n_q is None:
        raise ValueError(
            "QRM config.json has no num_quantiles field (the authors' class requires it); add it"
        )
    head_config = gating_head_config(hf_config, num_quantiles=int(n_q))
    return decoder_config(hf_config, head_type="qrm", n_outputs=1, head_config=head_config)


def _linear(sd: StateDict, key: str, shape: tuple, cfg: RewardModelConfig):
    W = sd.get(key)
    if W is None or tuple(W.shape) != shape:
        hc = cfg.head_config
        got = None if W is None else tuple(W.shape)
        fields = ", ".join(
            f"{k}={hc[k]}"
            for k in ("gating_n_hidden", "gating_hidden_dim", "num_objectives", "num_quantiles")
        )
        raise ValueError(f"{key} has shape {got}, expected {shape} from config ({fields})")
    return W


def convert_qrm_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    hc = cfg.head_config
    n_obj, n_q = hc["num_objectives"], hc["num_quantiles"]
    n_hidden, hidden = hc["gating_n_hidden"], hc["gating_hidden_dim"]

    def regression(sd: StateDict):
        return _linear(sd, "regression_layer.weight", (n_obj * n_q, cfg.d_model), cfg)

    out = gated_rest(sd, cfg, hf_config, "a QRM checkpoint", regression)
    dims = [cfg.d_model] + [hidden] * n_hidden
    for i in range(n_hidden):
        W = _linear(sd, f"gating.layers.{3 * i}.weight", (hidden, dims[i]), cfg)
        out[f"reward_head.W_gate.{i}"] = W.T
        bn = f"gating.layers.{3 * i + 2}."
        out[f"reward_head.bn_weight.{i}"] = sd[bn + "weight"]
        out[f"reward_head.bn_bias.{i}"] = sd[bn + "bias"]
        out[f"reward_head.bn_mean_{i}"] = sd[bn + "running_mean"]
        out[f"reward_head.bn_var_{i}"] = sd[bn + "running_var"]
    last = f"gating.layers.{3 * n_hidden}."
    out[f"reward_head.W_gate.{n_hidden}"] = _linear(sd, last + "weight", (n_obj, dims[-1]), cfg).T
    out["reward_head.b_gate"] = sd[last + "bias"]
    if f"gating.layers.{3 * n_hidden + 1}.weight" in sd:
        raise ValueError(
            f"the checkpoint has more gate layers than gating_n_hidden={n_hidden} describes; set "
            "gating_n_hidden in config.json to the number of hidden gate layers"
        )
    return out


for _arch in ("LlamaForRewardModelWithGating31", "LlamaForRewardModelWithGating3"):
    register(
        WeightMap(
            architecture=_arch,
            build_config=qrm_config,
            convert_layer=convert_llama_layer,
            convert_rest=convert_qrm_rest,
            notes="QRM: Llama + quantile regression layer (objectives x quantiles, averaged), transform "
            "matrix, gate with BatchNorm (eval statistics) at the last assistant header; no remote code.",
        )
    )
