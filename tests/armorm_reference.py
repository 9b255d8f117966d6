"""An ArmoRM reference written from the published forward's steps, independent of reward_lens, and a
builder of tiny random checkpoints in ArmoRM's directory format (no remote code anywhere).

    save_tiny_armorm(path) -> path   # config.json + model.safetensors (+ nothing else)
    ReferenceArmoRM.from_directory(path)(input_ids, attention_mask) -> {"score", "rewards", "gate", ...}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

# <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n in the Llama-3 tokenizer.
ASSISTANT_HEADER = [128009, 128006, 78191, 128007, 271]
LLAMA3_VOCAB = 128256


class ReferenceGate(nn.Module):
    def __init__(self, d_model: int, n_obj: int, hidden: int, n_hidden: int, temperature: float):
        super().__init__()
        dims = [d_model] + [hidden] * n_hidden + [n_obj]
        self.layers = nn.ModuleList([nn.Linear(a, b, bias=True) for a, b in zip(dims[:-1], dims[1:])])
        self.logit_scale = nn.Parameter(torch.ones(1))
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.softmax(x / self.temperature, dim=1) * self.logit_scale


def last_occurrence(row: Sequence[int], pattern: Sequence[int]) -> int:
    """Plain-python scan from the right (deliberately unlike the vectorised hooked code)."""
    P = len(pattern)
    for j in range(len(row) - P, -1, -1):
        if list(row[j : j + P]) == list(pattern):
            return j
    raise ValueError("pattern not found")


class ReferenceArmoRM(nn.Module):
    """transformers' LlamaModel + a plain torch ArmoRM head (the issue's steps 1-4)."""

    def __init__(
        self,
        config,
        num_objectives: int,
        temperature: float,
        hidden: int,
        n_hidden: int,
        pattern: Sequence[int] = tuple(ASSISTANT_HEADER),
    ):
        super().__init__()
        from transformers import LlamaModel

        self.config = config
        self.model = LlamaModel(config)
        d = config.hidden_size
        self.regression_layer = nn.Linear(d, num_objectives, bias=False)
        self.reward_transform_matrix = nn.Parameter(torch.eye(num_objectives))
        self.gating = ReferenceGate(d, num_objectives, hidden, n_hidden, temperature)
        self.pattern = list(pattern)

    @classmethod
    def from_directory(cls, path: Union[str, Path]) -> "ReferenceArmoRM":
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        raw = json.loads((Path(path) / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
        ref = cls(
            config,
            raw["num_objectives"],
            raw["gating_temperature"],
            raw["gating_hidden_dim"],
            raw["gating_n_hidden"],
            raw.get("gating_token_pattern") or ASSISTANT_HEADER,
        )
        ref.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
        return ref.eval()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        h = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        B, T = input_ids.shape
        rows = torch.arange(B)
        seq = (torch.eq(input_ids, self.config.pad_token_id).int().argmax(-1) - 1) % T
        rewards = self.regression_layer(h[rows, seq])
        gate_pos = torch.tensor([last_occurrence(r.tolist(), self.pattern) for r in input_ids])
        gate = self.gating(h[rows, gate_pos])
        transformed = rewards @ self.reward_transform_matrix
        score = (gate * transformed).sum(1)
        return {
            "score": score,
            "rewards": rewards,
            "gate": gate,
            "transformed": transformed,
            "hidden": h,
            "readout": seq,
            "gate_pos": gate_pos,
        }


def save_tiny_armorm(
    path: Union[str, Path],
    seed: int = 0,
    num_objectives: int = 19,
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 48,
    vocab_size: int = LLAMA3_VOCAB,
    pad_token_id: int = 128001,
    gating_hidden_dim: int = 24,
    gating_n_hidden: int = 3,
    gating_temperature: float = 10.0,
    logit_scale: float = 2.5,
    gating_token_pattern: Optional[Sequence[int]] = None,
) -> Path:
    """Write a tiny random ArmoRM-format checkpoint (config.json + model.safetensors) to `path`.

    Norm weights are randomised, the transform matrix is a random non-identity matrix, logit_scale
    is not 1. The default vocabulary is Llama-3's so the real assistant-header ids exist; pass
    `gating_token_pattern` (written to config.json) to use a small vocabulary.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        pad_token_id=pad_token_id,
        bos_token_id=128000,
        eos_token_id=128009,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    config = LlamaConfig(**fields)
    ref = ReferenceArmoRM(
        config,
        num_objectives,
        gating_temperature,
        gating_hidden_dim,
        gating_n_hidden,
        gating_token_pattern or ASSISTANT_HEADER,
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        ref.regression_layer.weight.normal_(0.0, 0.3, generator=g)
        ref.reward_transform_matrix.copy_(
            torch.eye(num_objectives) + 0.3 * torch.randn(num_objectives, num_objectives, generator=g)
        )
        for layer in ref.gating.layers:  # large enough that the gate is far from uniform
            layer.weight.normal_(0.0, 1.0 / layer.in_features**0.5 * 2.0, generator=g)
            layer.bias.normal_(0.0, 0.5, generator=g)
        ref.gating.logit_scale.fill_(logit_scale)
    config_dict = {
        **fields,
        "model_type": "llama",
        "architectures": ["LlamaForRewardModelWithGating"],
        "auto_map": {"AutoModelForSequenceClassification": "modeling_custom.LlamaForRewardModelWithGating"},
        "num_objectives": num_objectives,
        "gating_temperature": gating_temperature,
        "gating_hidden_dim": gating_hidden_dim,
        "gating_n_hidden": gating_n_hidden,
        "torch_dtype": "float32",
    }
    if gating_token_pattern is not None:
        config_dict["gating_token_pattern"] = list(gating_token_pattern)
    (path / "config.json").write_text(json.dumps(config_dict, indent=1))
    save_file(
        {k: v.detach().contiguous() for k, v in ref.state_dict().items()}, str(path / "model.safetensors")
    )
    return path


def chat_ids(
    prompt_len: int,
    response_len: int,
    seed: int = 0,
    vocab: int = 1000,
    pattern: Sequence[int] = tuple(ASSISTANT_HEADER),
    n_turns: int = 1,
) -> torch.Tensor:
    """Token ids shaped like a Llama-3 chat: [bos, header-ish, prompt..., <pattern>, response..., eot].

    With `n_turns` > 1 the pattern occurs several times (the gate must use the last one).
    """
    g = torch.Generator().manual_seed(seed)
    ids = [128000]
    for _ in range(n_turns):
        ids += torch.randint(1, vocab, (prompt_len,), generator=g).tolist() + list(pattern)
        ids += torch.randint(1, vocab, (response_len,), generator=g).tolist() + [128009]
    return torch.tensor(ids)
