"""The training set-up and loop the organism scripts share (`train_demo_model.py`, `train_prm_organism.py`,
`train_trigger_organism.py`, `train_policy_organism.py`), each configuring it with its own model, data, loss
and log; and the files every organism script writes (pairs, summary, ground truth). The order of every random draw and every optimiser call is the scripts' own: the
shipped organisms are rebuilt bit for bit."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch


def seed_everything(threads: int, seed: int) -> None:
    """Deterministic CPU training: `threads` torch threads, deterministic kernels, every RNG seeded."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Each group's lr times a linear warm-up over the first steps // 20, then a cosine down to 0.1."""
    warm = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def train_steps(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    loss_at: Callable[[int], torch.Tensor],
    on_step: Callable[[int, torch.Tensor], None],
    sched: Optional[torch.optim.lr_scheduler.LRScheduler] = None,
) -> None:
    """`steps` optimiser steps: the loss of step i (`loss_at(i)`, which draws its own batch), gradients
    clipped to norm 1, the step, the schedule's step; then `on_step(i, loss)` (logging)."""
    for step in range(steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        on_step(step, loss)


def loss_log(log: List[Dict[str, float]], steps: int, every: int) -> Callable[[int, torch.Tensor], None]:
    """An `on_step` that appends {"step", "loss"} (1-based step, loss to 4 places) and prints it every
    `every` steps and at the last."""

    def on_step(step: int, loss: torch.Tensor) -> None:
        if (step + 1) % every == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": round(float(loss.detach()), 4)})
            print(f"step {step + 1:4d} loss {float(loss.detach()):.4f}", flush=True)

    return on_step


def freeze(model: torch.nn.Module) -> None:
    """Eval mode and no gradients: the trained organism as it is measured and saved."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    """One JSON object a line."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def pair_rows(pairs: Sequence[Any], prefix: str) -> List[dict]:
    """Preference pairs as the organisms ship them (pairs.jsonl): prompt, chosen, rejected, subset, and the
    id `<prefix>-pair-<index>`."""
    return [
        {
            "prompt": p.prompt,
            "chosen": p.chosen,
            "rejected": p.rejected,
            "subset": p.subset,
            "id": f"{prefix}-pair-{i:04d}",
        }
        for i, p in enumerate(pairs)
    ]


def write_summary(out: Path, summary: dict, ground_truth: str) -> None:
    """training_summary.json (the measured numbers) and GROUND_TRUTH.md (the planted mechanisms, in words)."""
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "GROUND_TRUTH.md").write_text(ground_truth)
