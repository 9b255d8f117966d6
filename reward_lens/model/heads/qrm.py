"""QRM (`LlamaForRewardModelWithGating31` / `LlamaForRewardModelWithGating3`, nicolinho/QRM-Llama3.1-8B):
ArmoRM's gated multi-objective head with a distribution per objective (quantile regression) and a gate
with BatchNorm.

With `h = ln_final(resid)`, n objectives, m quantiles (x @ W convention):

    R        = h[readout] @ W_reg, reshaped [batch, n_obj, n_q]   (column j * n_q + q: objective j, quantile)
    E        = R.mean(quantiles)              the objectives' expected rewards [batch, n_obj]
    x        = h[gate_pos];  n_hidden x (x @ W_i -> ReLU -> BatchNorm_i (eval statistics))  -> @ W_out + b_out
    g        = softmax(x / temperature) * logit_scale                 [batch, n_obj]
    score    = sum_j g_j (E @ T)_j;   quantile q of the score: sum_j g_j (R[:, :, q] @ T)_j

The readout is ArmoRM's ((argmax(ids == pad) - 1) mod T), the gate position the last assistant header. The
score is linear in h[readout] along W_mean T g(prompt) (W_mean: W_reg averaged over quantiles); one
objective (`set_objective`, its expected reward), one quantile of the score (`set_quantile`), or both
(objective j's quantile q) can be read as the reward instead, as for ArmoRM.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.armorm import DEFAULT_GATING_PATTERN, ArmoRMHead, default_objective_names
from reward_lens.model.heads.base import RewardHeadBase, gather_positions, register_head
from reward_lens.model.validation import as_index


class QRMHead(ArmoRMHead):
    """QRM's head. Parameters: `W_reg` [d_model, n_obj * n_q], `reward_transform` [n_obj, n_obj], `W_gate[i]`
    [d_in, d_out] (hidden layers bias-free), `b_gate` [n_obj] (the output layer's bias), BatchNorm
    `bn_weight[i]`, `bn_bias[i]` and buffers `bn_mean.i`, `bn_var.i`, `logit_scale` [1].

    Hooks as ArmoRM's (`hook_objectives` [batch, pos, n_obj] expected rewards, `hook_pooled` [batch, n_obj],
    `hook_gate_input`, `hook_gate_logits`, `hook_gate`, `hook_transformed`, `hook_score`) plus
    `hook_quantiles` [batch, n_obj, n_q] (R at the readout).
    """

    final_norm_readers = (("W_reg", 0), ("W_gate.0", 0))
    gate_owner = "QRM"

    def __init__(self, cfg: RewardModelConfig):  # noqa: D107 (ArmoRM's parameters differ: built here)
        RewardHeadBase.__init__(self, cfg)
        hc = cfg.head_config
        n_obj, n_q = int(hc["num_objectives"]), int(hc["num_quantiles"])
        hidden, n_hidden = int(hc["gating_hidden_dim"]), int(hc["gating_n_hidden"])
        self.num_objectives, self.num_quantiles = n_obj, n_q
        self.temperature = float(hc["gating_temperature"])
        self.bn_eps = float(hc.get("batch_norm_eps", 1e-5))
        self.gating_pattern = list(hc.get("gating_pattern") or DEFAULT_GATING_PATTERN)
        self.objective_names = list(hc.get("objective_names") or default_objective_names(n_obj))
        self.W_reg = nn.Parameter(torch.empty(cfg.d_model, n_obj * n_q))
        self.reward_transform = nn.Parameter(torch.empty(n_obj, n_obj))
        dims = [cfg.d_model] + [hidden] * n_hidden + [n_obj]
        self.W_gate = nn.ParameterList([nn.Parameter(torch.empty(a, b)) for a, b in zip(dims[:-1], dims[1:])])
        self.b_gate = nn.Parameter(torch.zeros(n_obj))
        self.bn_weight = nn.ParameterList([nn.Parameter(torch.ones(hidden)) for _ in range(n_hidden)])
        self.bn_bias = nn.ParameterList([nn.Parameter(torch.zeros(hidden)) for _ in range(n_hidden)])
        for i in range(n_hidden):
            self.register_buffer(f"bn_mean_{i}", torch.zeros(hidden))
            self.register_buffer(f"bn_var_{i}", torch.ones(hidden))
        self.logit_scale = nn.Parameter(torch.ones(1))
        self._objective: Optional[int] = None
        self._quantile: Optional[int] = None
        hooks = (
            "objectives",
            "pooled",
            "quantiles",
            "gate_input",
            "gate_logits",
            "gate",
            "transformed",
            "score",
        )
        for name in hooks:
            setattr(self, f"hook_{name}", HookPoint())

    @property
    def family(self) -> str:
        return "qrm"

    # ------------------------------------------------------------------ what is read
    @property
    def quantile(self) -> Optional[int]:
        return self._quantile

    def set_quantile(self, quantile: Optional[int]) -> None:
        """Read quantile `quantile` (0-based) of the score (or of the selected objective); None: the mean."""
        if quantile is not None:
            levels = ", ".join(f"{q}: {v:.3g}" for q, v in enumerate(self.quantile_levels().tolist()))
            quantile = as_index(quantile, "quantile index", self.num_quantiles, hint=f" (levels {levels})")
        self._quantile = quantile

    def quantile_levels(self) -> torch.Tensor:
        """The quantile levels the regression layer was trained on: linspace(0, 1, n_q + 2)[1:-1]."""
        return torch.linspace(0.0, 1.0, self.num_quantiles + 2)[1:-1]

    def columns(self) -> Float[torch.Tensor, "d_model n_obj"]:
        """The regression columns read: the quantile mean of each objective, or quantile q's."""
        W = self.W_reg.view(self.W_reg.shape[0], self.num_objectives, self.num_quantiles)
        return W.mean(-1) if self._quantile is None else W[:, :, self._quantile]

    # ------------------------------------------------------------------ forward
    def gate(self, x: Float[torch.Tensor, "batch d_model"]) -> Float[torch.Tensor, "batch n_obj"]:
        x = self.hook_gate_input(x)
        for i, W in enumerate(self.W_gate[:-1]):
            x = F.relu(x @ W)
            mean, var = getattr(self, f"bn_mean_{i}"), getattr(self, f"bn_var_{i}")
            x = (x - mean) / torch.sqrt(var + self.bn_eps) * self.bn_weight[i] + self.bn_bias[i]
        logits = self.hook_gate_logits(x @ self.W_gate[-1] + self.b_gate)
        return self.hook_gate(F.softmax(logits / self.temperature, dim=-1) * self.logit_scale)

    def forward(self, h, readout, input_ids: Optional[torch.Tensor] = None) -> Float[torch.Tensor, " batch"]:
        B, n, m = h.shape[0], self.num_objectives, self.num_quantiles
        per_position = h @ self.W_reg
        self.hook_objectives(per_position.view(B, -1, n, m).mean(-1))
        R = self.hook_quantiles(gather_positions(per_position, readout).view(B, n, m))
        rewards = self.hook_pooled(R.mean(-1))
        read = rewards if self._quantile is None else R[:, :, self._quantile]
        return self.gated_score(read, h, input_ids)

    # ------------------------------------------------------------------ directions
    def direction(self, output: int = 0) -> Float[torch.Tensor, " d_model"]:
        if self._objective is not None:
            return self.columns()[:, self._objective]
        return super().direction(output)  # the clear error: no single direction for the gated score

    def objective_directions(self) -> Float[torch.Tensor, "n_obj d_model"]:
        return self.columns().T

    def direction_for(self, model, input_ids, attention_mask=None) -> Float[torch.Tensor, "batch d_model"]:
        """W T g(prompt) per row (W the columns read; g from a forward pass), or one column."""
        if self._objective is not None:
            return self.columns()[:, self._objective].expand(input_ids.shape[0], -1)
        grabbed = {}

        def grab(g: torch.Tensor, hook: HookPoint) -> None:
            grabbed["g"] = g

        model.run_with_hooks(input_ids, attention_mask, fwd_hooks=[(self.hook_gate.name, grab)])
        return (grabbed["g"] @ self.reward_transform.T) @ self.columns().T


register_head("qrm", QRMHead)
