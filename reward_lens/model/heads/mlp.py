"""MLP reward heads: `Linear -> ReLU -> ... -> Linear` on the final-norm output at the readout.

INF-ORM (`INFORMForSequenceClassification`), Qwen2.5-Math-RM (`Qwen2ForRewardModel`) and GRM
(`GRewardModel`, `vhead_layer_type="mlp"`) read their reward through such a head. With `h` the final-norm
output at the readout and layers (W_i, b_i), i = 0..n (x @ W convention):

    a_0 = h,   a_{i+1} = relu(a_i @ W_i + b_i)   (i < n),   logits = a_n @ W_n + b_n,   reward = logits @ c

(c = [1] for one label; a process reward model's two labels read log-odds, c = [-1, 1]). The head is
piecewise linear: with the ReLU masks m_i = [a_i @ W_i + b_i > 0] of a sequence frozen,

    reward = d . h + beta,   d = W_0 (m_0 * W_1 (m_1 * ... W_n c)),   beta = c . b_n + sum_i (m_i * v_i) . b_i

exactly (v_i the back-propagated vector at layer i), so each sequence has its own direction and bias
(`linear_readout`), and every decomposition of the reward into residual components stays exact. A patched
residual is scored by the head itself (`reward_from_final`: masks recomputed), never by the clean mask.

Pooling (`head_config["pooling"]`): "first_pad_minus_one" (INF-ORM, Qwen2.5-Math-RM: the token before
the first pad, wrapping to the last token), "grm" (GRM: the last position when row 0 starts with a pad,
else each row's attention-mask length - 1), "last_non_pad" (transformers' rule).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.armorm import armorm_readout_positions
from reward_lens.model.heads.base import RewardHeadBase, gather_positions, register_head, rightmost_non_pad
from reward_lens.model.validation import checked_arguments

POOLING_RULES = ("first_pad_minus_one", "grm", "last_non_pad")


def grm_readout_positions(
    input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], pad_token_id: Optional[int]
) -> Int[torch.Tensor, " batch"]:
    """GRM's rule: the batch is left-padded when row 0 starts with the pad id (then every row reads the
    last position), else right-padded (each row reads its attention-mask length - 1)."""
    B, T = input_ids.shape
    if pad_token_id is not None and int(input_ids[0, 0]) == pad_token_id or attention_mask is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=input_ids.device)
    return attention_mask.long().sum(-1).to(input_ids.device) - 1


def check_readout_attended(readout: torch.Tensor, attention_mask: Optional[torch.Tensor], rule: str) -> None:
    if attention_mask is None:
        return
    rows = torch.arange(len(readout), device=attention_mask.device)
    masked = ~attention_mask.bool()[rows, readout.to(attention_mask.device)]
    if bool(masked.any()):
        bad = torch.nonzero(masked).flatten().tolist()
        raise ValueError(
            f"the head's pooling rule ({rule}) reads a padded position in rows {bad}: pad with "
            "model.cfg.pad_token_id (or set it to the tokenizer's pad id)"
        )


class MLPHead(RewardHeadBase):
    """An MLP head (see the module docstring). Parameters `W_mlp[i]` [d_in, d_out], `b_mlp[i]` [d_out].

    Hooks: `hook_input` [batch, d_model] (h at the readout), `hook_hidden[i]` [batch, width] (pre-ReLU of
    hidden layer i), `hook_logits` [batch, n_labels], `hook_score` [batch].
    """

    final_norm_readers = (("W_mlp.0", 0),)
    nonlinear_readout = True

    def __init__(self, cfg: RewardModelConfig):
        super().__init__(cfg)
        hc = cfg.head_config
        widths = [int(w) for w in hc["hidden_sizes"]]
        self.pooling = str(hc.get("pooling", "last_non_pad"))
        if self.pooling not in POOLING_RULES:
            raise ValueError(
                f"unknown MLP-head pooling {self.pooling!r}; supported: {', '.join(POOLING_RULES)}"
            )
        contrast = [float(c) for c in hc.get("label_contrast", [1.0])]
        dims = [cfg.d_model] + widths + [len(contrast)]
        self.W_mlp = nn.ParameterList([nn.Parameter(torch.empty(a, b)) for a, b in zip(dims[:-1], dims[1:])])
        self.b_mlp = nn.ParameterList([nn.Parameter(torch.zeros(b)) for b in dims[1:]])
        self.contrast: List[float] = contrast  # a plain list (the model is built on the meta device)
        self.hook_input = HookPoint()
        self.hook_hidden = nn.ModuleList([HookPoint() for _ in widths])
        self.hook_logits = HookPoint()
        self.hook_score = HookPoint()

    @property
    def family(self) -> str:
        return f"mlp:{self.cfg.head_config.get('family', 'mlp')}"

    @property
    def is_gated(self) -> bool:
        return True  # a per-sequence direction: the ReLU masks gate it

    def readout_positions(self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask=None):
        pad = self.cfg.pad_token_id
        if self.pooling == "first_pad_minus_one":
            readout = armorm_readout_positions(input_ids, pad)
        elif self.pooling == "grm":
            readout = grm_readout_positions(input_ids, attention_mask, pad)
        else:
            readout = rightmost_non_pad(input_ids, pad)
        check_readout_attended(readout, attention_mask, self.pooling)
        return readout

    # ------------------------------------------------------------------ forward
    def label_contrast(self, like: torch.Tensor) -> torch.Tensor:
        """c: the reward is logits @ c (dtype and device of `like`)."""
        return torch.tensor(self.contrast, dtype=like.dtype, device=like.device)

    def layers(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.W_mlp, self.b_mlp))

    @checked_arguments(flags=("hooked",))
    def logits(self, x: torch.Tensor, hooked: bool = True) -> torch.Tensor:
        """The head's logits of inputs x [..., d_model] (hooks fire when `hooked`)."""
        layers = self.layers()
        for i, (W, b) in enumerate(layers[:-1]):
            pre = x @ W.to(x.dtype) + b.to(x.dtype)
            x = F.relu(self.hook_hidden[i](pre) if hooked else pre)
        W, b = layers[-1]
        return x @ W.to(x.dtype) + b.to(x.dtype)

    def forward(
        self,
        h: Float[torch.Tensor, "batch pos d_model"],
        readout: Int[torch.Tensor, " batch"],
        input_ids: Optional[torch.Tensor] = None,
    ) -> Float[torch.Tensor, " batch"]:
        x = self.hook_input(gather_positions(h, readout))
        logits = self.hook_logits(self.logits(x))
        return self.hook_score(logits @ self.label_contrast(logits))

    def reward_from_final(self, h: Float[torch.Tensor, "... d_model"]) -> torch.Tensor:
        hf = h.float()
        return self.logits(hf, hooked=False) @ self.label_contrast(hf)

    # ------------------------------------------------------------------ the frozen-mask linearisation
    def linearise(self, x: Float[torch.Tensor, "batch d_model"]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(direction [batch, d_model], bias [batch]) with reward = direction . x + bias exactly, the ReLU
        masks frozen at their values on x (float32)."""
        x = x.float()
        layers = [(W.float(), b.float()) for W, b in self.layers()]
        masks, a = [], x
        for W, b in layers[:-1]:
            pre = a @ W + b
            masks.append(pre > 0)
            a = F.relu(pre)
        W_last, b_last = layers[-1]
        c = self.label_contrast(x)
        v = (W_last @ c).expand(x.shape[0], -1)  # [batch, width of the last hidden layer]
        bias = (b_last @ c).expand(x.shape[0]).clone()
        for (W, b), m in zip(reversed(layers[:-1]), reversed(masks)):
            u = v * m
            bias = bias + u @ b
            v = u @ W.T
        return v, bias

    def readout_inputs(self, model, input_ids, attention_mask=None) -> torch.Tensor:
        """h at each sequence's readout (one forward pass)."""
        grabbed = {}

        def grab(x: torch.Tensor, hook: HookPoint) -> None:
            grabbed["x"] = x.detach()

        model.run_with_hooks(input_ids, attention_mask, fwd_hooks=[(self.hook_input.name, grab)])
        return grabbed["x"]

    def linear_readout(self, model, input_ids, attention_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.linearise(self.readout_inputs(model, input_ids, attention_mask))

    def direction_for(self, model, input_ids, attention_mask=None) -> Float[torch.Tensor, "batch d_model"]:
        return self.linear_readout(model, input_ids, attention_mask)[0]

    def direction(self, output: int = 0) -> torch.Tensor:
        raise ValueError(
            f"this {self.family} head is an MLP: its reward is linear in h only with the ReLU masks of "
            "one sequence frozen, so there is no single reward direction; use "
            "model.reward_direction_for(input_ids, attention_mask) (and model.reward_bias_for) for the "
            "per-sequence direction and bias"
        )

    def bias(self, output: int = 0) -> torch.Tensor:
        raise ValueError(
            f"this {self.family} head is an MLP: its bias depends on the sequence's ReLU masks; use "
            "model.reward_bias_for(input_ids, attention_mask)"
        )


def mlp_head_config(
    family: str, hidden_sizes: Sequence[int], pooling: str, label_contrast: Sequence[float] = (1.0,), **extra
) -> dict:
    """The `head_config` of an MLP head (what the weight maps write)."""
    return dict(
        family=family,
        hidden_sizes=[int(w) for w in hidden_sizes],
        pooling=pooling,
        label_contrast=[float(c) for c in label_contrast],
        **extra,
    )


register_head("mlp", MLPHead)
