"""Tiny random reward checkpoints built with transformers, for offline parity tests."""

from __future__ import annotations

import torch

ARCH_CONFIGS = {}


def randomise_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights away from 1 (and biases away from 0) so norm folding is really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=0, rms_norm_eps=1e-5,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}, rope_theta=500000.0)
        cls = transformers.LlamaForSequenceClassification
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4)
        cls = transformers.MistralForSequenceClassification
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        cls = transformers.Qwen2ForSequenceClassification
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24)
        cls = transformers.Qwen3ForSequenceClassification
    else:
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg, cls


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    cfg, cls = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomise_norms(model, seed)
    return model


def padded_batch(lengths, side: str, vocab: int = 97, pad: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        ids[i, sl] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, sl] = 1
    return ids, mask
