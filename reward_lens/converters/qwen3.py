"""Qwen3 (`Qwen3ForSequenceClassification`): Llama weights plus per-head RMSNorm on q and k before RoPE."""

from reward_lens.converters.llama import (
    convert_llama_layer,
    convert_llama_rest,
    decoder_config,
    layer_windows,
)
from reward_lens.converters.registry import WeightMap, register


def qwen3_config(hf_config):
    return decoder_config(hf_config, qk_norm=True, window_sizes=layer_windows(hf_config))


register(
    WeightMap(
        "Qwen3ForSequenceClassification",
        qwen3_config,
        convert_llama_layer,
        convert_llama_rest,
        notes="Llama map + q_norm/k_norm (kept unfolded: they act after the projection) + windows.",
    )
)
