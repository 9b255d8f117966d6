"""Qwen2 (`Qwen2ForSequenceClassification`): Llama weights plus q/k/v biases; sliding window per
`layer_types`."""

from reward_lens.converters.llama import (
    convert_llama_layer,
    convert_llama_rest,
    decoder_config,
    layer_windows,
)
from reward_lens.converters.registry import WeightMap, register


def qwen2_config(hf_config):
    return decoder_config(hf_config, window_sizes=layer_windows(hf_config))


register(
    WeightMap(
        "Qwen2ForSequenceClassification",
        qwen2_config,
        convert_llama_layer,
        convert_llama_rest,
        notes="Llama map + q/k/v biases (taken from the checkpoint) + per-layer sliding windows.",
    )
)
