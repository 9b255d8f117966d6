"""The reward-head protocol: what every head (scalar, ArmoRM, ...) tells the model and the instruments.

A head reads the final-norm output `h = ln_final(resid)` at each sequence's readout position. Everything
outside `reward_lens/model/heads/` asks the head through this base class, never by its type:

    final_norm_readers   (parameter, dim) pairs that read h: where the final norm's weight folds
    direction(j), bias(j)    the vector and offset of output j (reward = direction . h + bias)
    is_gated             the output has no single direction (ArmoRM's prompt-gated score)
    direction_for(...)   the per-sequence direction (= direction(0) for every row unless gated)
    objective_names, objective_directions(), set_objective(...)   multi-objective heads
    readout_positions(ids, mask)   where the reward is read (default: rightmost non-pad token)
    linear_readout(model, ids, mask)   per-sequence (direction, bias): exact for the sequence, with a
                         gate or a ReLU mask frozen at its value (one forward pass when not linear)
    reward_from_final(h)     the head re-applied to other final states h [..., d_model] (None: linear
                         given the frozen direction); what patched readouts are scored with
    family               the head family a report names ("linear", "armorm", "mlp:inform", ...)
    steps / step_rewards     process reward models: one readout per step (`read_step`)

`read_objective(model, objective)` is the one context manager that makes a multi-objective model read
one objective as its reward; `read_step(model, k)` makes a process reward model read step k.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn as nn
from jaxtyping import Float, Int

from reward_lens.model.config import RewardModelConfig

Objective = Union[int, str, None]


def gather_positions(x: torch.Tensor, positions: Int[torch.Tensor, " batch"]) -> torch.Tensor:
    """x[b, positions[b]] for x of shape [batch, pos, ...]."""
    return x[torch.arange(x.shape[0], device=x.device), positions.to(x.device)]


def last_position_without_pad(input_ids: Int[torch.Tensor, "batch pos"]) -> Int[torch.Tensor, " batch"]:
    """The readout when the config has no pad token: the last position, for one sequence only (as
    transformers refuses a batch it cannot find the padding of)."""
    batch, T = input_ids.shape
    if batch != 1:
        raise ValueError(
            "Cannot read out a reward for batch > 1 without a pad token: this checkpoint's config has no "
            "pad_token_id; set model.cfg.pad_token_id or run one sequence at a time."
        )
    return torch.full((batch,), T - 1, dtype=torch.long, device=input_ids.device)


def rightmost_non_pad(
    input_ids: Int[torch.Tensor, "batch pos"], pad_token_id: Optional[int]
) -> Int[torch.Tensor, " batch"]:
    """transformers' sequence-classification pooling: the rightmost token that is not the pad token."""
    if pad_token_id is None:
        return last_position_without_pad(input_ids)
    idx = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (idx * (input_ids != pad_token_id).long()).argmax(-1)


class RewardHeadBase(nn.Module):
    """What every reward head provides (see the module docstring). Subclasses set `final_norm_readers`
    and implement `forward`, `direction` and `bias`; multi-objective heads override the objective API."""

    # (parameter name, dim of length d_model) that the final norm's weight folds into.
    final_norm_readers: Tuple[Tuple[str, int], ...] = ()
    # Whether a patched final state must be scored by the head itself (`reward_from_final`): True for heads
    # not linear in h given a frozen direction (MLP heads recompute their ReLU masks).
    nonlinear_readout: bool = False
    # Multi-objective heads list their objectives; a scalar head has none.
    objective_names: Sequence[str] = ()

    def __init__(self, cfg: RewardModelConfig):
        super().__init__()
        self.cfg = cfg

    # ------------------------------------------------------------------ the linear readout
    def direction(self, output: int = 0) -> Float[torch.Tensor, " d_model"]:
        """The vector that, dotted with h, gives output `output` minus its bias."""
        raise NotImplementedError

    def bias(self, output: int = 0) -> torch.Tensor:
        raise NotImplementedError

    @property
    def is_gated(self) -> bool:
        """Whether the output is mixed by an input-dependent gate (no single reward direction)."""
        return False

    def direction_for(self, model, input_ids, attention_mask=None) -> Float[torch.Tensor, "batch d_model"]:
        """The direction each sequence's reward is read along, before the final norm's weight."""
        return self.direction(0).expand(input_ids.shape[0], -1)

    def linear_readout(self, model, input_ids, attention_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(direction [batch, d_model], bias [batch]) with reward = direction . h[readout] + bias for each
        sequence (before the final norm's weight). Linear and gated heads: `direction_for` and `bias(0)`."""
        direction = self.direction_for(model, input_ids, attention_mask)
        return direction, self.bias(0).expand(direction.shape[0])

    def reward_from_final(self, h: Float[torch.Tensor, "... d_model"]) -> Optional[torch.Tensor]:
        """The reward of final-norm outputs `h` when the head is not linear in them given its frozen
        direction (an MLP head recomputes its ReLU mask); None for heads whose direction is all they need."""
        return None

    @property
    def family(self) -> str:
        """The head family, as reports name it."""
        return "linear"

    @property
    def per_step(self) -> bool:
        """Whether a sequence has one readout per step (a process reward model)."""
        return False

    def step_rewards(self, model, input_ids, attention_mask=None) -> torch.Tensor:
        raise ValueError(
            "step_rewards needs a process reward model (one readout per step); this head is "
            f"{type(self).__name__} ({self.family})"
        )

    def set_step(self, step: Optional[int]) -> None:
        if step is not None:
            raise ValueError(
                f"step={step!r} needs a process reward model; this head is {type(self).__name__}"
            )

    @property
    def step(self) -> Optional[int]:
        return None

    def readout_positions(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask=None
    ) -> Int[torch.Tensor, " batch"]:
        """Where the reward is read, exactly as transformers pools: the rightmost non-pad token."""
        return rightmost_non_pad(input_ids, self.cfg.pad_token_id)

    def context_positions(
        self, input_ids: Int[torch.Tensor, "batch pos"]
    ) -> Optional[Int[torch.Tensor, " batch"]]:
        """Positions other than the readout whose final state the output reads (a gate's input); None when
        the head reads the readout alone. A readout-only recomputation is exact when these precede it."""
        return None

    # ------------------------------------------------------------------ objectives
    @property
    def n_objectives(self) -> int:
        return len(self.objective_names)

    def objective_directions(self) -> Optional[Float[torch.Tensor, "n_obj d_model"]]:
        """Row j dotted with h gives objective j (before the final norm's weight); None without objectives."""
        return None

    @property
    def objective(self) -> Optional[int]:
        """The objective read as the reward (None: the head's own output)."""
        return None

    def set_objective(self, objective: Objective) -> None:
        if objective is not None:
            raise ValueError(
                f"objective={objective!r} needs a multi-objective (ArmoRM) head; this head is "
                f"{type(self).__name__}"
            )


HEAD_TYPES: Dict[str, Type[RewardHeadBase]] = {}


def register_head(name: str, cls: Type[RewardHeadBase]) -> None:
    HEAD_TYPES[name] = cls


def head_class(cfg: RewardModelConfig) -> Type[RewardHeadBase]:
    try:
        return HEAD_TYPES[cfg.head_type]
    except KeyError:
        raise ValueError(
            f"unknown reward head type {cfg.head_type!r}; known head types: {sorted(HEAD_TYPES)}"
        ) from None


def build_head(cfg: RewardModelConfig) -> RewardHeadBase:
    return head_class(cfg)(cfg)


@contextlib.contextmanager
def read_objective(model, objective: Objective) -> Iterator:
    """Within the block the model's reward is one objective (name or index) of its multi-objective
    (ArmoRM) head; restored after. `objective=None` leaves the model as it is (so callers can pass an
    optional objective through); `model.reward_head.set_objective(None)` selects the gated score."""
    if objective is None:
        yield model
        return
    head = model.reward_head
    if not head.n_objectives:
        raise ValueError(f"read_objective needs an ArmoRM model; this model's head is {type(head).__name__}")
    before = head.objective
    head.set_objective(objective)
    try:
        yield model
    finally:
        head.set_objective(before)


@contextlib.contextmanager
def read_step(model, step: Optional[int]) -> Iterator:
    """Within the block a process reward model reads step `step` of every sequence (0-based; negative
    counts from each sequence's last step) as its reward, so every instrument studies that step; restored
    after. `step=None` leaves the model as it is."""
    if step is None:
        yield model
        return
    head = model.reward_head
    if not head.per_step:
        raise ValueError(
            f"read_step needs a process reward model; this model's head is {type(head).__name__}"
        )
    before = head.step
    head.set_step(step)
    try:
        yield model
    finally:
        head.set_step(before)
