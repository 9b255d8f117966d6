"""Process reward models (Qwen2.5-Math-PRM, `Qwen2ForProcessRewardModel`): one readout per step.

The head is the MLP head (`reward_lens.model.heads.mlp`) with two labels, read at every step tag (the
token `<extra_0>` ends each step). The reward of a step is its log-odds `logit[1] - logit[0]` (the model
card's step probability, softmax class 1, is its sigmoid), so the label contrast is c = [-1, 1].

A sequence has several readouts: `step_rewards` gives every step's reward [batch, max_steps] (NaN after
a sequence's last step); the model's output, and what every instrument decomposes, is the reward of
the selected step (`set_step` / `reward_lens.read_step`; default -1, each sequence's last step; 0-based,
negative counts from the end).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from jaxtyping import Int

from reward_lens.model import hooks
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.base import gather_positions, register_head
from reward_lens.model.heads.mlp import MLPHead
from reward_lens.model.validation import as_index

DEFAULT_STEP_TAG = "<extra_0>"


class ProcessRewardHead(MLPHead):
    """The MLP head read at step tags (`head_config["step_tag_id"]`); `step` selects the readout."""

    def __init__(self, cfg: RewardModelConfig):
        super().__init__(cfg)
        self._step_tag_id: Optional[int] = None
        self.step_tag_id = cfg.head_config.get("step_tag_id")
        self._step: int = -1

    @property
    def step_tag_id(self) -> Optional[int]:
        return self._step_tag_id

    @step_tag_id.setter
    def step_tag_id(self, tag: Optional[int]) -> None:
        """A token id of the vocabulary: an id past it would match no token (every step reward NaN)."""
        self._step_tag_id = None if tag is None else as_index(tag, "step tag id", self.cfg.d_vocab)

    @property
    def family(self) -> str:
        return f"prm:{self.cfg.head_config.get('family', 'prm')}"

    @property
    def per_step(self) -> bool:
        return True

    @property
    def step(self) -> Optional[int]:
        return self._step

    def set_step(self, step: Optional[int]) -> None:
        """Read step `step` (None: the last step, -1)."""
        self._step = -1 if step is None else as_index(step, "step", negative=True)

    def tag_id(self) -> int:
        if self.step_tag_id is None:
            raise ValueError(
                "this process reward model has no step tag id: load it with a tokenizer that has "
                f"{DEFAULT_STEP_TAG!r}, or pass step_tag_id=<token id> (or set "
                "model.reward_head.step_tag_id)"
            )
        return self.step_tag_id

    def step_mask(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        tags = input_ids == self.tag_id()
        if attention_mask is not None:
            tags = tags & attention_mask.bool().to(tags.device)
        return tags

    def step_positions(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """[batch, max_steps] positions of each sequence's step tags, -1 after its last step."""
        tags = self.step_mask(input_ids, attention_mask)
        counts = tags.sum(-1)
        S = max(int(counts.max()), 1) if tags.numel() else 1
        out = torch.full((input_ids.shape[0], S), -1, dtype=torch.long, device=input_ids.device)
        rows, cols = torch.nonzero(tags, as_tuple=True)
        rank = tags.long().cumsum(-1)[rows, cols] - 1
        out[rows, rank] = cols
        return out

    def step_index(self, input_ids: torch.Tensor, attention_mask=None) -> Int[torch.Tensor, "batch pos"]:
        """The step each token belongs to (0-based: the tokens up to and including step j's tag are step j),
        to group a token attribution at step k by the earlier steps that moved it."""
        tags = self.step_mask(input_ids, attention_mask).long()
        return tags.cumsum(-1) - tags

    def readout_positions(self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask=None):
        tags = self.step_mask(input_ids, attention_mask)
        counts = tags.sum(-1)
        k = torch.full_like(counts, self._step) + (counts if self._step < 0 else 0)
        bad = (k < 0) | (k >= counts)
        if bool(bad.any()):
            rows = torch.nonzero(bad).flatten().tolist()
            raise ValueError(
                f"rows {rows} of input_ids have {counts[bad].tolist()} step tags (id {self.tag_id()}), so "
                f"step {self._step} does not exist there; end every step with the step tag, or read "
                "another step (reward_lens.read_step)"
            )
        return self.step_positions(input_ids, attention_mask).gather(1, k[:, None])[:, 0]

    def step_rewards(self, model, input_ids, attention_mask=None) -> torch.Tensor:
        """Every step's reward (log-odds) [batch, max_steps], NaN after a sequence's last step; a sequence
        without step tags is refused, as the model's forward refuses it."""
        counts = self.step_mask(input_ids, attention_mask).sum(-1)
        if bool((counts == 0).any()):
            rows = torch.nonzero(counts == 0).flatten().tolist()
            raise ValueError(
                f"rows {rows} of input_ids have no step tag (id {self.tag_id()}), so they have no step "
                "rewards; end every step with the step tag (Qwen2.5-Math-PRM: '<extra_0>')"
            )
        grabbed = {}

        def grab(resid: torch.Tensor, hook) -> None:
            grabbed["resid"] = resid

        name = hooks.act_name("resid_post", model.cfg.n_layers - 1)
        with torch.no_grad():
            model.run_with_hooks(input_ids, attention_mask, return_type=None, fwd_hooks=[(name, grab)])
            positions = self.step_positions(input_ids.to(grabbed["resid"].device), attention_mask)
            valid = positions >= 0
            resid = torch.stack([gather_positions(grabbed["resid"], p.clamp(min=0)) for p in positions.T], 1)
            rewards = self.reward_from_final(model.ln_final(resid.to(self.b_mlp[0].device)))
        return torch.where(valid.to(rewards.device), rewards, torch.full_like(rewards, float("nan")))


register_head("prm", ProcessRewardHead)


def resolve_step_tag(model, step_tag: Optional[Union[str, int]] = None) -> None:
    """Set a process reward model's step tag id: `step_tag` (a token or an id) when given, else the
    tokenizer's `<extra_0>` when the checkpoint names none. A step tag for a model that has no steps is an
    error; a model that is not a PRM is left as it is."""
    head = model.reward_head
    if not head.per_step:
        if step_tag is not None:
            raise ValueError(
                f"step_tag={step_tag!r} is for process reward models; this head is {type(head).__name__}"
            )
        return
    if step_tag is None and head.step_tag_id is not None:
        return
    tag = DEFAULT_STEP_TAG if step_tag is None else step_tag
    if isinstance(tag, str):
        tok = model.tokenizer
        ids = [] if tok is None else tok.encode(tag, add_special_tokens=False)
        unknown = len(ids) == 1 and is_unknown_token(tok, tag, ids[0])
        if len(ids) != 1 or unknown:
            if step_tag is None:  # no tokenizer tag: the user must name it before reading steps
                return
            what = "unknown to this tokenizer (read as its unk token)" if unknown else f"{len(ids)} tokens"
            raise ValueError(
                f"step_tag={tag!r} is {what} in this tokenizer (or there is no tokenizer); pass a single "
                "token of its vocabulary or its id"
            )
        tag = ids[0]
    head.step_tag_id = tag  # checked: an integer id of the vocabulary
    model.cfg.head_config["step_tag_id"] = head.step_tag_id


def is_unknown_token(tokenizer, text: str, token_id: int) -> bool:
    """`text` encoded as the tokenizer's unknown token (and not the unknown token's own text)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return unk is not None and int(token_id) == int(unk) and text != getattr(tokenizer, "unk_token", None)
