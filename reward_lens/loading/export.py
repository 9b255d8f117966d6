"""The inverse weight map: a HookedRewardModel back to a transformers `LlamaForSequenceClassification`
checkpoint (config.json + safetensors + tokenizer files), e.g. after editing its weights.

ours -> transformers (the Llama map in `converters/llama.py`, inverted):
  embed.W_E                       -> model.embed_tokens.weight
  blocks.l.attn.W_{Q,K,V} [n,d,h] -> model.layers.l.self_attn.{q,k,v}_proj.weight [n*h, d] (+ biases)
  blocks.l.attn.W_O [n,h,d]       -> model.layers.l.self_attn.o_proj.weight [d, n*h] (+ bias)
  blocks.l.mlp.W_{gate,in,out}    -> model.layers.l.mlp.{gate,up,down}_proj.weight (+ up/down biases)
  blocks.l.ln1.w / ln2.w          -> input_layernorm / post_attention_layernorm weights
  ln_final.w                      -> model.norm.weight
  reward_head.W_R [d, n_out]      -> score.weight [n_out, d]

Folded models (fold_ln=True) carry no norm weights: the checkpoint gets norm weights of ones and keeps the
folded projection weights, which computes exactly the same function (RMSNorm(x)·1 then diag(g)-scaled W).
Any Llama-like model without architecture quirks (Llama, Mistral without sliding window, Qwen2 without
sliding window: its q/k/v biases become `attention_bias=True` with zero o_proj bias) exports; anything
transformers' Llama cannot compute (sliding windows, q/k norms, Gemma norms, soft-caps, ArmoRM's head, a
score bias) is a clear error rather than a silently different model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Union

import torch

from reward_lens.converters.llama import rope_inverse_frequencies
from reward_lens.converters.registry import StateDict
from reward_lens.model.devices import resolve_dtype
from reward_lens.model.heads.scalar import RewardHead

ARCHITECTURE = "LlamaForSequenceClassification"


def _check_exportable(model) -> None:
    cfg = model.cfg
    problems = []
    linear_head = isinstance(model.reward_head, RewardHead)
    if not linear_head:
        problems.append(
            f"head_type={cfg.head_type!r} (only a linear score head maps onto transformers' Llama)"
        )
    if any(w is not None for w in cfg.window_sizes):
        problems.append("sliding-window attention")
    if cfg.qk_norm:
        problems.append("q/k norms (Qwen3)")
    if (
        cfg.post_norms
        or cfg.norm_weight_offset
        or cfg.embed_scale is not None
        or cfg.attn_scores_soft_cap is not None
    ):
        problems.append("Gemma-style norms / embedding scale / soft-capping")
    if abs(cfg.attn_scale - cfg.d_head**0.5) > 1e-6 * cfg.attn_scale:
        problems.append(f"attention scale {cfg.attn_scale} != sqrt(d_head)")
    if cfg.rotary_dim != cfg.d_head:
        problems.append(f"partial rotary (rotary_dim={cfg.rotary_dim}, d_head={cfg.d_head})")
    if linear_head and bool((model.reward_head.b_R != 0).any()):
        problems.append("a score bias (LlamaForSequenceClassification's score has none)")
    if getattr(cfg, "readout", "last_non_pad") != "last_non_pad":
        problems.append(f"readout {cfg.readout!r} (transformers reads the rightmost non-pad token)")
    if problems:
        raise ValueError(
            "cannot export this model as a transformers LlamaForSequenceClassification checkpoint: "
            + "; ".join(problems)
        )


def _rope_parameters(model, hf_config: Any) -> Dict[str, Any]:
    """RoPE parameters for the config: the original config's, or inferred for plain (unscaled) RoPE."""
    if hf_config is not None:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        params = dict(getattr(text, "rope_parameters", None) or {})
        if not params:
            params = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", 10000.0))}
        return params
    inv_freq = model.rotary.inv_freq.double()
    if inv_freq.numel() < 2 or model.cfg.rotary_attention_scaling != 1.0:
        raise ValueError(
            "cannot infer this model's RoPE settings; pass hf_config=<the original transformers config>"
        )
    dim = 2 * inv_freq.numel()
    theta = float(inv_freq[1] ** (-dim / 2.0))
    return {"rope_type": "default", "rope_theta": theta}


def llama_config(model, hf_config: Any = None):
    """A transformers LlamaConfig for the hooked model (RoPE from `hf_config` when given)."""
    from transformers import LlamaConfig

    cfg = model.cfg
    attention_bias = any(
        bool((getattr(b.attn, name) != 0).any())
        for b in model.blocks
        for name in ("b_Q", "b_K", "b_V", "b_O")
    )
    mlp_bias = any(bool((b.mlp.b_in != 0).any()) or bool((b.mlp.b_out != 0).any()) for b in model.blocks)
    config = LlamaConfig(
        vocab_size=cfg.d_vocab,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_mlp,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_key_value_heads,
        head_dim=cfg.d_head,
        max_position_embeddings=cfg.n_ctx,
        rms_norm_eps=cfg.eps,
        hidden_act=cfg.act_fn,
        num_labels=cfg.n_outputs,
        pad_token_id=cfg.pad_token_id,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=False,
        rope_parameters=_rope_parameters(model, hf_config),
    )
    config.architectures = [ARCHITECTURE]
    for attr in ("bos_token_id", "eos_token_id"):
        value = getattr(hf_config, attr, None) if hf_config is not None else None
        setattr(config, attr, value)
    inv_freq, scaling = rope_inverse_frequencies(config)
    ours = model.rotary.inv_freq.float().cpu()
    if (
        inv_freq.shape != ours.shape
        or not torch.allclose(inv_freq.float(), ours, rtol=1e-5, atol=0)
        or abs(scaling - cfg.rotary_attention_scaling) > 1e-6
    ):
        raise ValueError(
            "the RoPE settings would not reproduce this model's rotary frequencies; pass hf_config=<the "
            "original transformers config> (e.g. AutoConfig.from_pretrained(original_checkpoint))"
        )
    return config


def to_llama_state_dict(model) -> StateDict:
    """transformers LlamaForSequenceClassification state dict of the hooked model (norm weights unfolded)."""
    cfg = model.cfg
    d = cfg.d_model
    folded = model.ln_final.w is None
    ones = torch.ones(d, dtype=cfg.dtype)
    bias_attn = any(
        bool((getattr(b.attn, n) != 0).any()) for b in model.blocks for n in ("b_Q", "b_K", "b_V", "b_O")
    )
    bias_mlp = any(bool((b.mlp.b_in != 0).any()) or bool((b.mlp.b_out != 0).any()) for b in model.blocks)
    sd: StateDict = {"model.embed_tokens.weight": model.embed.W_E}
    for l, block in enumerate(model.blocks):
        p = f"model.layers.{l}."
        att = block.attn
        sd[p + "input_layernorm.weight"] = ones if folded else block.ln1.w
        sd[p + "post_attention_layernorm.weight"] = ones if folded else block.ln2.w
        for name in ("q", "k", "v"):
            W = getattr(att, f"W_{name.upper()}")  # [heads, d, h] -> [heads*h, d]
            sd[p + f"self_attn.{name}_proj.weight"] = W.transpose(1, 2).reshape(-1, d)
            if bias_attn:
                sd[p + f"self_attn.{name}_proj.bias"] = getattr(att, f"b_{name.upper()}").reshape(-1)
        sd[p + "self_attn.o_proj.weight"] = att.W_O.reshape(-1, d).T
        if bias_attn:
            sd[p + "self_attn.o_proj.bias"] = att.b_O
        sd[p + "mlp.gate_proj.weight"] = block.mlp.W_gate.T
        sd[p + "mlp.up_proj.weight"] = block.mlp.W_in.T
        sd[p + "mlp.down_proj.weight"] = block.mlp.W_out.T
        if bias_mlp:
            sd[p + "mlp.gate_proj.bias"] = torch.zeros(cfg.d_mlp, dtype=cfg.dtype)
            sd[p + "mlp.up_proj.bias"] = block.mlp.b_in
            sd[p + "mlp.down_proj.bias"] = block.mlp.b_out
    sd["model.norm.weight"] = ones if folded else model.ln_final.w
    sd["score.weight"] = model.reward_head.W_R.T
    return {
        k: v.detach().to("cpu").clone().contiguous() for k, v in sd.items()
    }  # no shared storage (safetensors)


def export_hf(
    model,
    path: Union[str, Path],
    *,
    hf_config: Any = None,
    dtype: Union[str, torch.dtype, None] = None,
    max_shard_size: int = 5 * 2**30,
) -> Path:
    """Save `model` as a transformers `LlamaForSequenceClassification` checkpoint directory that
    `from_pretrained` loads and that gives the same rewards.

    hf_config: the original transformers config, needed for scaled RoPE (llama3, yarn, ...); plain RoPE is
    inferred. dtype: the saved weights' dtype (default: the model's). Weights above `max_shard_size` bytes
    are sharded with a `model.safetensors.index.json`, as transformers does.
    """
    from safetensors.torch import save_file

    _check_exportable(model)
    config = llama_config(model, hf_config)
    sd = to_llama_state_dict(model)
    out_dtype = resolve_dtype(dtype) if dtype is not None else model.cfg.dtype
    sd = {k: v.to(out_dtype) for k, v in sd.items()}
    _check_keys(config, sd)
    config.dtype = str(out_dtype).replace("torch.", "")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    shards, current, size = [], {}, 0
    for key, value in sd.items():
        nbytes = value.numel() * value.element_size()
        if current and size + nbytes > max_shard_size:
            shards.append(current)
            current, size = {}, 0
        current[key] = value
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in sd.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))
    return path


def _check_keys(config, sd: StateDict) -> None:
    """Our key set and shapes must be exactly what transformers' class expects (built on the meta device)."""
    from transformers import LlamaForSequenceClassification

    with torch.device("meta"):
        reference = LlamaForSequenceClassification(config).state_dict()
    missing, unexpected = set(reference) - set(sd), set(sd) - set(reference)
    wrong = [k for k in set(reference) & set(sd) if tuple(reference[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or wrong:
        raise RuntimeError(
            f"internal error in the Llama export map: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}, wrong shapes {sorted(wrong)[:5]}; please report it"
        )
