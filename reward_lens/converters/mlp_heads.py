"""Reward models with MLP heads, loaded as their authors save them (no remote code):

  INFORMForSequenceClassification (INF-ORM-Llama3.1-70B): Llama + `score` = Linear(d, d), ReLU, Linear(d, 1)
  Qwen2ForRewardModel (Qwen2.5-Math-RM-72B): Qwen2 + the same `score` MLP
  Qwen2ForProcessRewardModel (Qwen2.5-Math-PRM-7B/72B): Qwen2 + `score` MLP with 2 labels, read at step tags
  GRewardModel (GRM, Ray2333): any decoder under `model.` + `v_head.summary`, `vhead_num_layers` x
      (Linear(., vhead_num_neurons), ReLU) then Linear(., 1); one Linear when `vhead_layer_type` is "linear"

The decoder is the base family's own weight map (by `model_type`: Llama, Qwen2, Mistral, Gemma-2, ...).
transformers `nn.Sequential` layout -> ours: `{prefix}.{k}.weight` [out, in] -> reward_head.W_mlp.i [in, out],
`.bias` -> reward_head.b_mlp.i (zeros when absent), the Linear layers k in order.

Pooling: INF-ORM and Qwen2.5-Math-RM read the token before the first pad (wrapping to the last token,
`(argmax(ids == pad) - 1) mod T`); GRM reads the last position when row 0 begins with a pad, else each row's
mask length - 1; the PRM reads every `<extra_0>` (see `reward_lens.model.heads.prm`).
"""

from __future__ import annotations

from typing import Any, List

import torch

import reward_lens.model.heads.mlp  # noqa: F401  (registers the "mlp" head type)
import reward_lens.model.heads.prm  # noqa: F401  (registers the "prm" head type)
from reward_lens.converters.llama import convert_decoder_rest, rope_inverse_frequencies
from reward_lens.converters.openrlhf import base_weight_map
from reward_lens.converters.registry import StateDict, WeightMap, register
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.mlp import mlp_head_config

GRM_LAYER_TYPES = ("mlp", "linear")


def _config(hf_config: Any, head_type: str, head_config: dict) -> RewardModelConfig:
    cfg = base_weight_map(hf_config).build_config(hf_config)
    cfg.head_type, cfg.head_config, cfg.n_outputs = head_type, head_config, 1
    cfg.original_architecture = (hf_config.architectures or ["?"])[0]
    return cfg


def inform_config(hf_config: Any) -> RewardModelConfig:
    d = hf_config.get_text_config().hidden_size
    return _config(hf_config, "mlp", mlp_head_config("inform", [d], "first_pad_minus_one"))


def qwen2_rm_config(hf_config: Any) -> RewardModelConfig:
    d = hf_config.get_text_config().hidden_size
    return _config(hf_config, "mlp", mlp_head_config("qwen2-rm", [d], "first_pad_minus_one"))


def qwen2_prm_config(hf_config: Any) -> RewardModelConfig:
    d = hf_config.get_text_config().hidden_size
    n_labels = int(getattr(hf_config, "num_labels", 2) or 2)
    if n_labels != 2:
        raise ValueError(
            f"Qwen2ForProcessRewardModel config field num_labels={n_labels} is not supported: reward-lens "
            "reads the two-class step head (log-odds of class 1); supported: 2"
        )
    tag = getattr(hf_config, "step_tag_id", None)
    head_config = mlp_head_config(
        "qwen2-prm", [d], "last_non_pad", (-1.0, 1.0), step_tag_id=None if tag is None else int(tag)
    )
    return _config(hf_config, "prm", head_config)


def grm_config(hf_config: Any) -> RewardModelConfig:
    layer_type = getattr(hf_config, "vhead_layer_type", "mlp")
    if layer_type not in GRM_LAYER_TYPES:
        raise ValueError(
            f"GRewardModel config field vhead_layer_type={layer_type!r} is not supported; supported: "
            f"{', '.join(GRM_LAYER_TYPES)}"
        )
    widths: List[int] = []
    if layer_type == "mlp":
        neurons = int(getattr(hf_config, "vhead_num_neurons", 1024))
        widths = [neurons] * int(getattr(hf_config, "vhead_num_layers", 1))
    return _config(hf_config, "mlp", mlp_head_config("grm", widths, "grm", vhead_layer_type=layer_type))


def convert_mlp(sd: StateDict, cfg: RewardModelConfig, prefix: str, linear_keys: List[str]) -> StateDict:
    """`{prefix}.{k}` Linear layers -> W_mlp.i / b_mlp.i, shapes checked against the config."""
    widths = list(cfg.head_config["hidden_sizes"])
    dims = [cfg.d_model] + widths + [len(cfg.head_config["label_contrast"])]
    out: StateDict = {}
    for i, key in enumerate(linear_keys):
        W = sd.get(f"{key}.weight")
        want = (dims[i + 1], dims[i])
        if W is None or tuple(W.shape) != want:
            got = None if W is None else tuple(W.shape)
            raise ValueError(
                f"{key}.weight has shape {got}, expected {want} from the config (head layers "
                f"{widths or 'none'} over d_model={cfg.d_model}); the checkpoint's head and config disagree"
            )
        bias = sd.get(f"{key}.bias")
        out[f"reward_head.W_mlp.{i}"] = W.T
        out[f"reward_head.b_mlp.{i}"] = bias if bias is not None else torch.zeros(W.shape[0], dtype=W.dtype)
    extra = f"{prefix}.{2 * len(linear_keys)}.weight"
    if extra in sd:
        raise ValueError(
            f"the checkpoint has head layer {extra!r} beyond the {len(linear_keys)} Linear layers the "
            "config describes; fix the head fields of config.json (e.g. vhead_num_layers)"
        )
    return out


def sequential_keys(prefix: str, n_linear: int) -> List[str]:
    """Keys of the Linear layers of `nn.Sequential(Linear, ReLU, Linear, ...)`: prefix.0, prefix.2, ..."""
    return [f"{prefix}.{2 * i}" for i in range(n_linear)]


def convert_score_mlp_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    n_linear = len(cfg.head_config["hidden_sizes"]) + 1
    if "score.0.weight" not in sd:
        outside = sorted(k for k in sd if not k.startswith("model."))[:8]
        raise ValueError(
            f"not a {cfg.original_architecture} checkpoint: its MLP head 'score.0.weight' is missing "
            f"(tensors outside model.*: {outside})"
        )
    head = convert_mlp(sd, cfg, "score", sequential_keys("score", n_linear))
    return {**_decoder_rest(sd, cfg, hf_config), **head}


def convert_grm_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    widths = cfg.head_config["hidden_sizes"]
    keys = ["v_head.summary"] if not widths else sequential_keys("v_head.summary", len(widths) + 1)
    if f"{keys[0]}.weight" not in sd:
        found = sorted(k for k in sd if k.startswith("v_head"))[:8] or "no v_head tensors"
        raise ValueError(
            f"GRewardModel checkpoint without '{keys[0]}.weight' "
            f"(vhead_layer_type={cfg.head_config['vhead_layer_type']!r}); found {found}"
        )
    return {**_decoder_rest(sd, cfg, hf_config), **convert_mlp(sd, cfg, "v_head.summary", keys)}


def _decoder_rest(sd: StateDict, cfg: RewardModelConfig, hf_config: Any) -> StateDict:
    inv_freq = rope_inverse_frequencies(hf_config.get_text_config())[0]
    return {**convert_decoder_rest(sd, cfg), "rotary.inv_freq": inv_freq}


def convert_base_layer(sd: StateDict, cfg: RewardModelConfig, hf_config: Any, l: int) -> StateDict:
    return base_weight_map(hf_config).convert_layer(sd, cfg, hf_config, l)


for _arch, _build, _rest, _notes in (
    (
        "INFORMForSequenceClassification",
        inform_config,
        convert_score_mlp_rest,
        "INF-ORM: Llama + score MLP (Linear d->d, ReLU, Linear d->1); readout before the first pad.",
    ),
    (
        "Qwen2ForRewardModel",
        qwen2_rm_config,
        convert_score_mlp_rest,
        "Qwen2.5-Math-RM: Qwen2 + score MLP (Linear d->d, ReLU, Linear d->1); readout before the first pad.",
    ),
    (
        "Qwen2ForProcessRewardModel",
        qwen2_prm_config,
        convert_score_mlp_rest,
        "Qwen2.5-Math-PRM: Qwen2 + score MLP with 2 labels read at every <extra_0>; step reward = log-odds.",
    ),
    (
        "GRewardModel",
        grm_config,
        convert_grm_rest,
        "GRM: base decoder + v_head.summary (vhead_num_layers x Linear+ReLU, Linear ->1, or one Linear); "
        "GRM's padding rule.",
    ),
):
    register(WeightMap(_arch, _build, convert_base_layer, _rest, notes=_notes))
