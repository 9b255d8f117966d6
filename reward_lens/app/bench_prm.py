"""The process-RM rows of `reward-lens bench`, scored on the PRM organism (`reward_lens/demo/prm_organism/`).

Each held-out item has one first wrong step j and at least one later step; the organism was trained so that
step j and every later step are bad. Two questions:

  which earlier step lowered the last step's score?  `read_step(model, -1)`, `token_attribution` of that
      step's reward, the response tokens' attribution summed per step (`reward_head.step_index`): step j's
      tokens should carry the most negative total;
  where does the solution go wrong?  `model.step_rewards`: the first step whose reward is below 0 should
      be step j.
"""

from __future__ import annotations

import json
from typing import List

import numpy as np
import torch

ASSISTANT_TOKEN = "<|assistant|>"  # the demo chat template's response marker, followed by one newline


def prm_items() -> List[dict]:
    """The PRM organism's held-out items: prompt, response, labels (per step), first_wrong, id."""
    from reward_lens.demo import DEMO_DIR

    with open(DEMO_DIR / "prm_organism" / "items.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def response_mask(model, ids: torch.Tensor) -> torch.Tensor:
    """[pos] True at the response's tokens of one unpadded sequence (after `<|assistant|>` and its
    newline)."""
    marker = model.tokenizer.convert_tokens_to_ids(ASSISTANT_TOKEN)
    where = torch.nonzero(ids == marker).flatten()
    if len(where) != 1:
        raise ValueError(f"expected one {ASSISTANT_TOKEN} token in the sequence, found {len(where)}")
    return torch.arange(len(ids)) > int(where[0]) + 1


def step_attribution(model, items: List[dict], step: int = -1):
    """(token attribution result at `step`, [per item: per-step totals of its response tokens' terms])."""
    from reward_lens import read_step, token_attribution

    with read_step(model, step):
        tok = token_attribution(model, [(it["prompt"], it["response"]) for it in items])
    per_step = []
    for i, it in enumerate(items):
        values = torch.as_tensor(tok.token_values("text", i), dtype=torch.float64)
        # the attributed tokens run from the first real token to the readout (later ones cannot move it)
        ids = model.to_tokens(it["prompt"], it["response"])["input_ids"][0].cpu()[: len(values)]
        if len(values) != tok.readout["text"][i] + 1 or len(ids) != len(values):
            raise ValueError(f"item {it['id']}: {len(values)} attributed tokens do not end at the readout")
        steps = model.reward_head.step_index(ids[None])[0].cpu()
        keep = response_mask(model, ids)
        totals = torch.zeros(int(steps.max()) + 1, dtype=torch.float64)
        per_step.append(totals.index_add_(0, steps[keep], values[keep]))
    return tok, per_step


def first_wrong_step_share(ctx) -> float:
    """Share of items whose first wrong step has the most negative per-step total at the last step."""
    model = ctx.organism("prm")
    items = prm_items()
    _, per_step = ctx.get("prm_step_attribution", lambda: step_attribution(model, items))
    return float(np.mean([int(t.argmin()) == it["first_wrong"] for t, it in zip(per_step, items)]))


def first_negative_step_share(ctx) -> float:
    """Share of items whose first step with reward below 0 (`step_rewards`) is the first wrong step."""
    model = ctx.organism("prm")
    items = prm_items()
    hits = []
    for it in items:
        tok = model.to_tokens(it["prompt"], it["response"])
        rewards = model.step_rewards(tok["input_ids"], attention_mask=tok["attention_mask"])[0]
        below = torch.nonzero(rewards < 0).flatten()
        hits.append(len(below) > 0 and int(below[0]) == it["first_wrong"])
    return float(np.mean(hits))
