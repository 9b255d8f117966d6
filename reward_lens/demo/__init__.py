"""The embedded demo reward model: a small Llama RM trained here with planted length and sycophancy biases.

It ships inside the package (a hooked checkpoint, ~4 MB) so that the first command works offline:

    from reward_lens import load_demo_model, demo_pairs
    model = load_demo_model()          # HookedRewardModel with its tokenizer and chat template
    pairs = demo_pairs()               # its held-out preference pairs (RewardBench columns)

GROUND_TRUTH.md documents what was planted; `scripts/train_demo_model.py` regenerates every file here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from reward_lens.data.pairs import load_pairs
from reward_lens.loading.native import HookedRewardModel

DEMO_DIR = Path(__file__).resolve().parent
DEMO_WEIGHTS_PATH = DEMO_DIR / "model.safetensors"
DEMO_PAIRS_PATH = DEMO_DIR / "pairs.jsonl"
DEMO_PROBE_ITEMS_PATH = DEMO_DIR / "probe_items.jsonl"
GROUND_TRUTH_PATH = DEMO_DIR / "GROUND_TRUTH.md"
TRAINING_SUMMARY_PATH = DEMO_DIR / "training_summary.json"
DEMO_TRANSCODERS_DIR = DEMO_DIR / "transcoders"  # `scripts/train_demo_transcoders.py` writes it
DEMO_MODEL_NAME = "reward-lens-demo"


def _require(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(
            f"the demo model file {path.name} is missing from {DEMO_DIR}; reinstall reward-lens or "
            "regenerate it with `python scripts/train_demo_model.py`"
        )


def load_demo_model(
    device: Union[str, torch.device, None] = None, dtype: Union[str, torch.dtype, None] = None
):
    """The demo reward model as a HookedRewardModel (offline; the weights ship in the package); `device`
    defaults to CUDA when available, else CPU."""

    _require(DEMO_WEIGHTS_PATH)
    return HookedRewardModel.from_pretrained(DEMO_DIR, device=device, dtype=dtype)


def demo_pairs():
    """The demo model's held-out preference pairs (subsets arithmetic, facts, instructions, length,
    sycophancy)."""
    _require(DEMO_PAIRS_PATH)
    return load_pairs(DEMO_PAIRS_PATH)


__all__ = [
    "DEMO_DIR",
    "DEMO_PAIRS_PATH",
    "DEMO_PROBE_ITEMS_PATH",
    "DEMO_WEIGHTS_PATH",
    "GROUND_TRUTH_PATH",
    "TRAINING_SUMMARY_PATH",
    "DEMO_TRANSCODERS_DIR",
    "DEMO_MODEL_NAME",
    "load_demo_model",
    "demo_pairs",
]
