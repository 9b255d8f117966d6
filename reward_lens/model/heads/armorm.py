"""ArmoRM (`LlamaForRewardModelWithGating`): a multi-objective regression head mixed by a prompt gate.

With `h = ln_final(resid)` ([batch, pos, d_model]) the published forward is

    seq      = (argmax(input_ids == pad) - 1) mod T          readout (last token when unpadded)
    rewards  = h[b, seq] @ W_reg                             [batch, n_obj]  (19 objectives)
    gate_pos = start of the last `gating_pattern` in the row  (`<|eot_id|>...assistant...\\n\\n`)
    x        = h[b, gate_pos] -> n_hidden x (Linear + ReLU) -> Linear        gate logits [batch, n_obj]
    g        = softmax(x / temperature) * logit_scale                         [batch, n_obj]
    score    = sum_j g_j (rewards @ T)_j                                      [batch]

The score is linear in h[readout] with the prompt-conditioned direction W_reg T g (see
`HookedRewardModel.reward_direction_for`); there is no single reward direction. One objective can be
read as the reward instead (`ArmoRMHead.set_objective` / `read_objective`), and then the model is an
ordinary linear reward model along W_reg[:, j].
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.base import (
    Objective,
    RewardHeadBase,
    gather_positions,
    last_position_without_pad,
    register_head,
)
from reward_lens.model.validation import as_index

# The 19 objectives of RLHFlow/ArmoRM-Llama3-8B-v0.1, in the order of its regression layer's rows.
ARMORM_OBJECTIVES: tuple = (
    "helpsteer-helpfulness",
    "helpsteer-correctness",
    "helpsteer-coherence",
    "helpsteer-complexity",
    "helpsteer-verbosity",
    "ultrafeedback-overall_score",
    "ultrafeedback-instruction_following",
    "ultrafeedback-truthfulness",
    "ultrafeedback-honesty",
    "ultrafeedback-helpfulness",
    "beavertails-is_safe",
    "prometheus-score",
    "argilla-overall_quality",
    "argilla-judge_lm",
    "code-complexity",
    "code-style",
    "code-explanation",
    "code-instruction-following",
    "code-readability",
)
# `<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n` in the Llama-3 tokenizer.
DEFAULT_GATING_PATTERN: tuple = (128009, 128006, 78191, 128007, 271)


def default_objective_names(num_objectives: int) -> List[str]:
    if num_objectives == len(ARMORM_OBJECTIVES):
        return list(ARMORM_OBJECTIVES)
    return [f"objective_{j}" for j in range(num_objectives)]


def last_pattern_positions(
    input_ids: Int[torch.Tensor, "batch pos"], pattern: Sequence[int]
) -> Int[torch.Tensor, " batch"]:
    """Start index of the last occurrence of `pattern` in each row; a row without it is an error."""
    P = len(pattern)
    batch, T = input_ids.shape
    if P == 0:
        raise ValueError(
            "the gating token pattern is empty; set model.reward_head.gating_pattern to a token list"
        )
    if T >= P:
        want = torch.tensor(list(pattern), dtype=input_ids.dtype, device=input_ids.device)
        match = (input_ids.unfold(1, P, 1) == want).all(-1)  # [batch, T - P + 1]
    else:
        match = torch.zeros(batch, 0, dtype=torch.bool, device=input_ids.device)
    found = match.any(-1)
    if not bool(found.all()):
        rows = torch.nonzero(~found).flatten().tolist()
        raise ValueError(
            f"ArmoRM's gate reads the token pattern {list(pattern)} (the assistant header that ends the "
            f"prompt), but rows {rows} of input_ids do not contain it; format the input with the "
            "checkpoint's chat template, or set model.reward_head.gating_pattern to the token ids that "
            "end your prompts"
        )
    idx = torch.arange(match.shape[1], device=input_ids.device)
    return (idx * match.long()).argmax(-1)  # rightmost match (a lone match at 0 gives 0 too)


def armorm_readout_positions(
    input_ids: Int[torch.Tensor, "batch pos"], pad_token_id: Optional[int]
) -> Int[torch.Tensor, " batch"]:
    """ArmoRM's rule: the token before the first pad, wrapping to the last token when a row has no pad
    (and when the row is left-padded, the first pad being at 0)."""
    if pad_token_id is None:
        return last_position_without_pad(input_ids)
    T = input_ids.shape[1]
    first_pad = (input_ids == pad_token_id).int().argmax(-1)
    return (first_pad - 1) % T


class ArmoRMHead(RewardHeadBase):
    """ArmoRM's head. Parameters (x @ W convention, like TransformerLens):
    `W_reg` [d_model, n_obj], `reward_transform` [n_obj, n_obj] (T), `W_gate[i]` [d_in, d_out],
    `b_gate[i]` [d_out] for the n_hidden + 1 gate layers, `logit_scale` [1].

    Hooks: `hook_objectives` [batch, pos, n_obj] (objective rewards at every position),
    `hook_pooled` [batch, n_obj] (at the readout), `hook_gate_input` [batch, d_model] (h at the gate
    position), `hook_gate_logits` [batch, n_obj], `hook_gate` [batch, n_obj] (g),
    `hook_transformed` [batch, n_obj] (rewards @ T), `hook_score` [batch].
    """

    # The final norm's weight folds into both maps that read h.
    final_norm_readers = (("W_reg", 0), ("W_gate.0", 0))
    gate_owner = "ArmoRM"  # named in the error of a gated forward without token ids

    def __init__(self, cfg: RewardModelConfig):
        super().__init__(cfg)
        hc = cfg.head_config
        n_obj = int(hc["num_objectives"])
        hidden, n_hidden = int(hc["gating_hidden_dim"]), int(hc["gating_n_hidden"])
        self.num_objectives = n_obj
        self.temperature = float(hc["gating_temperature"])
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"config.json has gating_temperature={hc['gating_temperature']!r}; ArmoRM's gate computes "
                "softmax(x / temperature), so it must be a finite number > 0 (ArmoRM ships 10)"
            )
        self.gating_pattern: List[int] = list(hc.get("gating_pattern") or DEFAULT_GATING_PATTERN)
        self.objective_names: List[str] = list(hc.get("objective_names") or default_objective_names(n_obj))
        if len(self.objective_names) != n_obj:
            raise ValueError(f"{len(self.objective_names)} objective names for {n_obj} objectives")
        self.W_reg = nn.Parameter(torch.empty(cfg.d_model, n_obj))
        self.reward_transform = nn.Parameter(torch.empty(n_obj, n_obj))
        dims = [cfg.d_model] + [hidden] * n_hidden + [n_obj]
        self.W_gate = nn.ParameterList([nn.Parameter(torch.empty(a, b)) for a, b in zip(dims[:-1], dims[1:])])
        self.b_gate = nn.ParameterList([nn.Parameter(torch.zeros(b)) for b in dims[1:]])
        self.logit_scale = nn.Parameter(torch.ones(1))
        self._objective: Optional[int] = None  # None: the model returns the gated score
        self.hook_objectives = HookPoint()
        self.hook_pooled = HookPoint()
        self.hook_gate_input = HookPoint()
        self.hook_gate_logits = HookPoint()
        self.hook_gate = HookPoint()
        self.hook_transformed = HookPoint()
        self.hook_score = HookPoint()

    # ------------------------------------------------------------------ objective selection
    def objective_index(self, objective: Union[int, str]) -> int:
        if isinstance(objective, str):
            if objective not in self.objective_names:
                raise ValueError(f"unknown objective {objective!r}; known: {', '.join(self.objective_names)}")
            return self.objective_names.index(objective)
        return as_index(objective, "objective index", self.num_objectives, hint=" (or give its name)")

    @property
    def objective(self) -> Optional[int]:
        return self._objective

    @objective.setter
    def objective(self, objective: Objective) -> None:
        self.set_objective(objective)

    def set_objective(self, objective: Objective) -> None:
        """Make the model's output objective `objective` (name or index) instead of the gated score;
        None restores the score. With an objective set the gate is not computed."""
        self._objective = None if objective is None else self.objective_index(objective)

    @property
    def is_gated(self) -> bool:
        return self._objective is None

    @property
    def family(self) -> str:
        return "armorm"

    # ------------------------------------------------------------------ positions
    def readout_positions(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask=None
    ) -> torch.Tensor:
        readout = armorm_readout_positions(input_ids, self.cfg.pad_token_id)
        if attention_mask is not None:
            masked = ~attention_mask.bool()[torch.arange(len(readout), device=readout.device), readout]
            if bool(masked.any()):
                raise ValueError(
                    f"ArmoRM reads the reward before the first pad_token_id ({self.cfg.pad_token_id}), "
                    f"but rows {torch.nonzero(masked).flatten().tolist()} would read a padded position: "
                    "the ids were padded with another token; pad with model.cfg.pad_token_id (or set it "
                    "to the tokenizer's pad id)"
                )
        return readout

    def gate_positions(self, input_ids: Int[torch.Tensor, "batch pos"]) -> Int[torch.Tensor, " batch"]:
        return last_pattern_positions(input_ids, self.gating_pattern)

    def context_positions(
        self, input_ids: Int[torch.Tensor, "batch pos"]
    ) -> Optional[Int[torch.Tensor, " batch"]]:
        return self.gate_positions(input_ids) if self.is_gated else None

    # ------------------------------------------------------------------ forward
    def gate(self, x: Float[torch.Tensor, "batch d_model"]) -> Float[torch.Tensor, "batch n_obj"]:
        """g from the final-norm output at the gate position (hooks fire)."""
        x = self.hook_gate_input(x)
        last = len(self.W_gate) - 1
        for i, (W, b) in enumerate(zip(self.W_gate, self.b_gate)):
            x = x @ W + b
            if i < last:
                x = F.relu(x)
        logits = self.hook_gate_logits(x)
        return self.hook_gate(F.softmax(logits / self.temperature, dim=-1) * self.logit_scale)

    def forward(
        self,
        h: Float[torch.Tensor, "batch pos d_model"],
        readout: Int[torch.Tensor, " batch"],
        input_ids: Optional[torch.Tensor] = None,
    ) -> Float[torch.Tensor, " batch"]:
        rewards = self.hook_pooled(gather_positions(self.hook_objectives(h @ self.W_reg), readout))
        return self.gated_score(rewards, h, input_ids)

    def gated_score(
        self,
        read: Float[torch.Tensor, "batch n_obj"],
        h: Float[torch.Tensor, "batch pos d_model"],
        input_ids: Optional[torch.Tensor],
    ) -> Float[torch.Tensor, " batch"]:
        """The output from the objective rewards `read`: the selected objective's, else the prompt gate's
        weighted sum of the transformed rewards (the gate read from `h` at the prompt's end)."""
        if self._objective is not None:
            return read[:, self._objective]
        if input_ids is None:
            raise ValueError(
                f"{self.gate_owner}'s gate needs the token ids to find the prompt's end; pass input_ids= "
                "(also when starting from a residual with start_at_layer), or select one objective with "
                "model.reward_head.set_objective"
            )
        g = self.gate(gather_positions(h, self.gate_positions(input_ids)))
        transformed = self.hook_transformed(read @ self.reward_transform)
        return self.hook_score((g * transformed).sum(-1))

    # ------------------------------------------------------------------ directions
    def direction(self, output: int = 0) -> Float[torch.Tensor, " d_model"]:
        if self._objective is not None:
            return self.W_reg[:, self._objective]
        raise ValueError(
            "ArmoRM has no single reward direction: its score is W_reg T g(prompt) . h with a "
            "prompt-dependent gate g. Use model.reward_direction_for(input_ids, attention_mask) for the "
            "[batch, d_model] direction, or read one objective with "
            "model.reward_head.set_objective(name) (then model.reward_direction is W_reg[:, j])."
        )

    def bias(self, output: int = 0) -> torch.Tensor:
        return torch.zeros((), dtype=self.W_reg.dtype, device=self.W_reg.device)

    def objective_directions(self) -> Float[torch.Tensor, "n_obj d_model"]:
        """Row j dotted with h gives objective j (before the final norm's weight, if unfolded)."""
        return self.W_reg.T

    def direction_for(self, model, input_ids, attention_mask=None) -> Float[torch.Tensor, "batch d_model"]:
        """W_reg T g(prompt) per row (g from a forward pass), or W_reg[:, j] when an objective is set."""
        if self._objective is not None:
            return self.W_reg[:, self._objective].expand(input_ids.shape[0], -1)
        grabbed = {}

        def grab(g: torch.Tensor, hook: HookPoint) -> None:
            grabbed["g"] = g

        model.run_with_hooks(input_ids, attention_mask, fwd_hooks=[(self.hook_gate.name, grab)])
        return (grabbed["g"] @ self.reward_transform.T) @ self.W_reg.T  # rows: W_reg T g


register_head("armorm", ArmoRMHead)
