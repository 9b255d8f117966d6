"""Reference forwards of the MLP-head reward models, written from their authors' definitions and independent
of reward_lens, and builders of tiny random checkpoints saved with the authors' parameter names.

    save_tiny(kind, path) -> path          # config.json + model.safetensors, kind in KINDS
    Reference.from_directory(path)(ids, mask) -> {"reward", "hidden", "readout", ...}

INF-ORM / Qwen2.5-Math-RM: decoder + `score = Sequential(Linear(d, d), ReLU, Linear(d, 1))`, pooled at
(argmax(ids == pad) - 1) mod T. GRM: `model` + `v_head.summary` (vhead_num_layers x [Linear, ReLU] + Linear,
or one Linear), pooled at T - 1 when row 0 starts with pad, else mask.sum - 1. Qwen2.5-Math-PRM: the score
MLP with two labels at every step tag; step reward = logit[1] - logit[0].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn as nn

KINDS = ("inform", "qwen2_rm", "grm", "grm_linear", "grm_deep", "qwen2_prm")
ARCHITECTURE = {
    "inform": "INFORMForSequenceClassification",
    "qwen2_rm": "Qwen2ForRewardModel",
    "grm": "GRewardModel",
    "grm_linear": "GRewardModel",
    "grm_deep": "GRewardModel",
    "qwen2_prm": "Qwen2ForProcessRewardModel",
}
MODEL_TYPE = {
    "inform": "llama",
    "qwen2_rm": "qwen2",
    "grm": "llama",
    "grm_linear": "llama",
    "grm_deep": "qwen2",
    "qwen2_prm": "qwen2",
}
PAD, STEP_TAG, VOCAB = 0, 96, 97
GRM_NEURONS = 40


def head_fields(kind: str) -> dict:
    if kind == "grm":
        return {"vhead_layer_type": "mlp", "vhead_num_neurons": GRM_NEURONS, "vhead_num_layers": 1}
    if kind == "grm_deep":
        return {"vhead_layer_type": "mlp", "vhead_num_neurons": GRM_NEURONS, "vhead_num_layers": 2}
    if kind == "grm_linear":
        return {"vhead_layer_type": "linear", "vhead_num_neurons": GRM_NEURONS, "vhead_num_layers": 1}
    return {"num_labels": 2} if kind == "qwen2_prm" else {"num_labels": 1}


def build_head(kind: str, d: int) -> nn.Module:
    if kind.startswith("grm"):
        f = head_fields(kind)
        if f["vhead_layer_type"] == "linear":
            return nn.Linear(d, 1)
        mods, width = [], d
        for _ in range(f["vhead_num_layers"]):
            mods += [nn.Linear(width, f["vhead_num_neurons"]), nn.ReLU()]
            width = f["vhead_num_neurons"]
        return nn.Sequential(*mods, nn.Linear(width, 1))
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2 if kind == "qwen2_prm" else 1))


class Reference(nn.Module):
    def __init__(self, kind: str, config):
        super().__init__()
        from transformers import LlamaModel, Qwen2Model

        self.kind, self.config = kind, config
        self.model = (LlamaModel if MODEL_TYPE[kind] == "llama" else Qwen2Model)(config)
        head = build_head(kind, config.hidden_size)
        if kind.startswith("grm"):
            self.v_head = nn.Module()
            self.v_head.summary = head
        else:
            self.score = head

    @classmethod
    def from_directory(cls, path) -> "Reference":
        from safetensors.torch import load_file
        from transformers import LlamaConfig, Qwen2Config

        raw = json.loads((Path(path) / "config.json").read_text())
        kind = raw["reference_kind"]
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "reference_kind")}
        config = (LlamaConfig if raw["model_type"] == "llama" else Qwen2Config)(**fields)
        ref = cls(kind, config)
        ref.load_state_dict(load_file(str(Path(path) / "model.safetensors")), strict=True)
        return ref.eval()

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.v_head.summary(x) if self.kind.startswith("grm") else self.score(x)

    def pooled_at(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        if self.kind.startswith("grm"):
            if ids[0][0].item() == self.config.pad_token_id:
                return torch.full((B,), T - 1)
            return mask.sum(-1) - 1
        return (torch.eq(ids, self.config.pad_token_id).int().argmax(-1) - 1) % T

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        mask = torch.ones_like(ids) if mask is None else mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        h = self.model(ids, attention_mask=mask, position_ids=pos).last_hidden_state
        logits = self.head(h)  # [B, T, n_labels]
        out = {"hidden": h, "logits": logits}
        if self.kind == "qwen2_prm":  # the model card: per step, the softmax of the two logits at <extra_0>
            steps = []
            for b in range(ids.shape[0]):
                where = [t for t in range(ids.shape[1]) if ids[b, t] == STEP_TAG and mask[b, t]]
                probs = logits[b, where].softmax(-1)[:, 1]
                steps.append(torch.log(probs) - torch.log1p(-probs))
            out["steps"], out["step_probs"] = steps, [torch.sigmoid(s) for s in steps]
            return out
        readout = self.pooled_at(ids, mask)
        out["readout"] = readout
        out["reward"] = logits[torch.arange(ids.shape[0]), readout, 0]
        return out


def save_tiny(kind: str, path, seed: int = 0, vocab_size: int = VOCAB, pad_token_id: int = PAD) -> Path:
    """A tiny random checkpoint of `kind` (config.json + model.safetensors), norms and biases randomised,
    head weights large enough that about half of its ReLUs are off."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen2Config

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
        pad_token_id=pad_token_id,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **head_fields(kind),
    )
    torch.manual_seed(seed)
    config = (LlamaConfig if MODEL_TYPE[kind] == "llama" else Qwen2Config)(**fields)
    ref = Reference(kind, config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    raw = {
        **fields,
        "model_type": MODEL_TYPE[kind],
        "architectures": [ARCHITECTURE[kind]],
        "auto_map": {"AutoModel": "modeling_custom.Model"},
        "torch_dtype": "float32",
        "reference_kind": kind,
    }
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    tensors = {k: v.detach().contiguous() for k, v in ref.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def padded(rows, side: str, pad: int = PAD):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    return ids, mask


def random_rows(lengths, seed: int = 0, steps: bool = False):
    """Token rows (ids 3..94) of the given lengths; with `steps`, a step tag every 4 tokens and at the end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        r = torch.randint(3, 95, (n,), generator=g).tolist()
        if steps:
            for t in range(3, n, 4):
                r[t] = STEP_TAG
            r[-1] = STEP_TAG
        rows.append(r)
    return rows
