"""A QRM reference written from the published forward (`LlamaForRewardModelWithGating31`), independent of
reward_lens, and a builder of tiny random checkpoints in QRM's directory format (no remote code anywhere).

    save_tiny_qrm(path) -> path
    ReferenceQRM.from_directory(path)(ids, mask) -> {"score", "rewards", "expectations", "quantiles", ...}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from armorm_reference import ASSISTANT_HEADER, LLAMA3_VOCAB, last_occurrence


class ReferenceGating(nn.Module):
    """n_hidden x [Linear(no bias), ReLU, BatchNorm1d], then Linear(bias); softmax(x / T) * logit_scale."""

    def __init__(self, d: int, n_obj: int, hidden: int, n_hidden: int, temperature: float):
        super().__init__()
        layers = []
        for _ in range(n_hidden):
            layers += [nn.Linear(d, hidden, bias=False), nn.ReLU(), nn.BatchNorm1d(hidden)]
            d = hidden
        layers.append(nn.Linear(d, n_obj, bias=True))
        self.layers = nn.ModuleList(layers)
        self.logit_scale = nn.Parameter(torch.ones(1))
        self.temperature = temperature

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return F.softmax(x / self.temperature, dim=1) * self.logit_scale[0]


class ReferenceQRM(nn.Module):
    def __init__(
        self,
        config,
        n_obj: int,
        n_q: int,
        temperature: float,
        hidden: int,
        n_hidden: int,
        pattern: Sequence[int] = tuple(ASSISTANT_HEADER),
    ):
        super().__init__()
        from transformers import LlamaModel

        self.config, self.n_obj, self.n_q, self.pattern = config, n_obj, n_q, list(pattern)
        self.model = LlamaModel(config)
        self.regression_layer = nn.Linear(config.hidden_size, n_obj * n_q, bias=False)
        self.reward_transform_matrix = nn.Parameter(torch.eye(n_obj))
        self.gating = ReferenceGating(config.hidden_size, n_obj, hidden, n_hidden, temperature)

    @classmethod
    def from_directory(cls, path) -> "ReferenceQRM":
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        raw = json.loads((Path(path) / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
        ref = cls(
            config,
            raw["num_objectives"],
            raw["num_quantiles"],
            raw["gating_temperature"],
            raw["gating_hidden_dim"],
            raw["gating_n_hidden"],
            raw.get("gating_token_pattern") or ASSISTANT_HEADER,
        )
        ref.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
        return ref.eval()

    @torch.no_grad()
    def forward(self, ids, mask) -> Dict[str, torch.Tensor]:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = self.model(ids, attention_mask=mask, position_ids=pos).last_hidden_state
        B, T = ids.shape
        rows = torch.arange(B)
        seq = (torch.eq(ids, self.config.pad_token_id).int().argmax(-1) - 1) % T
        R = self.regression_layer(h[rows, seq]).reshape(B, self.n_obj, self.n_q)
        gate_pos = torch.tensor([last_occurrence(r.tolist(), self.pattern) for r in ids])
        gate = self.gating(h[rows, gate_pos])
        T_ = self.reward_transform_matrix
        expectations = R.mean(dim=2)
        rewards = expectations @ T_
        score = (gate * rewards).sum(1)
        per_q = torch.stack([(gate * (R[:, :, q] @ T_)).sum(1) for q in range(self.n_q)], 1)  # [B, n_q]
        return {
            "score": score,
            "rewards": rewards,
            "expectations": expectations,
            "quantile_rewards": R,
            "quantiles": per_q,
            "gate": gate,
            "readout": seq,
        }


def save_tiny_qrm(
    path,
    seed: int = 0,
    *,
    n_obj: int = 19,
    n_q: int = 5,
    vocab_size: int = LLAMA3_VOCAB,
    pad_token_id: int = 128001,
    gating_token_pattern=None,
    architecture="LlamaForRewardModelWithGating31",
):
    """A tiny random QRM checkpoint: norms, BatchNorm statistics and affine terms random, logit_scale 1.7."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        pad_token_id=pad_token_id,
        bos_token_id=128000,
        eos_token_id=128009,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    pattern = gating_token_pattern or ASSISTANT_HEADER
    ref = ReferenceQRM(LlamaConfig(**fields), n_obj, n_q, 10.0, 24, 3, pattern)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        ref.regression_layer.weight.normal_(0.0, 0.3, generator=g)
        ref.reward_transform_matrix.copy_(torch.eye(n_obj) + 0.3 * torch.randn(n_obj, n_obj, generator=g))
        for layer in ref.gating.layers:
            if isinstance(layer, nn.Linear):
                layer.weight.normal_(0.0, 2.0 / layer.in_features**0.5, generator=g)
                if layer.bias is not None:
                    layer.bias.normal_(0.0, 0.5, generator=g)
            elif isinstance(layer, nn.BatchNorm1d):
                layer.weight.copy_(1.0 + 0.3 * torch.randn(layer.num_features, generator=g))
                layer.bias.normal_(0.0, 0.3, generator=g)
                layer.running_mean.copy_(0.5 * torch.rand(layer.num_features, generator=g))
                layer.running_var.copy_(0.5 + torch.rand(layer.num_features, generator=g))
        ref.gating.logit_scale.fill_(1.7)
    raw = {
        **fields,
        "model_type": "llama",
        "architectures": [architecture],
        "auto_map": {"AutoModelForSequenceClassification": "modeling_custom." + architecture},
        "num_objectives": n_obj,
        "num_quantiles": n_q,
        "gating_temperature": 10.0,
        "gating_hidden_dim": 24,
        "gating_n_hidden": 3,
        "torch_dtype": "float32",
    }
    if gating_token_pattern is not None:
        raw["gating_token_pattern"] = list(gating_token_pattern)
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    tensors = {k: v.detach().contiguous() for k, v in ref.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path
