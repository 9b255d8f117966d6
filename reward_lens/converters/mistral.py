"""Mistral (`MistralForSequenceClassification`): Llama weights; one sliding window on every layer when set."""

from reward_lens.converters.llama import convert_llama_layer, convert_llama_rest, decoder_config
from reward_lens.converters.registry import WeightMap, register


def mistral_config(hf_config):
    window = getattr(hf_config, "sliding_window", None)
    return decoder_config(hf_config, window_sizes=[window] * hf_config.num_hidden_layers)


register(
    WeightMap(
        "MistralForSequenceClassification",
        mistral_config,
        convert_llama_layer,
        convert_llama_rest,
        notes="Llama map + sliding-window attention on all layers when config.sliding_window is set.",
    )
)
