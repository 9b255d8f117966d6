"""Generative judges read as reward models: any causal LM asked a yes/no question about a response.

The reward is the logit difference of two answer tokens at the last position of the rendered text,

    reward = logit(positive) - logit(negative) = h[last] . (W_U[positive] - W_U[negative])

(plus the difference of the unembedding biases, if any), exactly linear in the final-norm output h with the
one direction W_U[positive] - W_U[negative]: the linear head, with `W_R` that difference (tied embeddings:
W_U = W_E). `head_config` records the answer tokens (`positive`, `negative` and their ids).
"""

from __future__ import annotations

from reward_lens.model.heads.base import register_head
from reward_lens.model.heads.scalar import RewardHead


class JudgeHead(RewardHead):
    """The linear head of a judge: W_R = W_U[positive] - W_U[negative] (see the module docstring)."""

    @property
    def family(self) -> str:
        hc = self.cfg.head_config
        return f"judge:{hc.get('positive', '?')}-vs-{hc.get('negative', '?')}"

    @property
    def answer_tokens(self):
        """(positive id, negative id)."""
        hc = self.cfg.head_config
        return int(hc["positive_id"]), int(hc["negative_id"])


register_head("judge", JudgeHead)
