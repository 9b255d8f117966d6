"""Theory-grounded extensions: distortion index, misalignment cascades, reward-term conflicts.

Each takes plain data (arrays, frames, directions) and has thin adapters for models and probe results.
Definitions: the module docstrings and docs/theory.md.
"""

from reward_lens.theory.cascades import CascadeResult, detect_cascades
from reward_lens.theory.conflicts import (
    ConflictResult,
    conflicts_from_directions,
    reward_conflicts,
    term_directions,
)
from reward_lens.theory.distortion import DistortionResult, distortion_from_directions, distortion_index
from reward_lens.theory.distortion_model import distortion_from_model

__all__ = [
    "CascadeResult",
    "ConflictResult",
    "DistortionResult",
    "conflicts_from_directions",
    "detect_cascades",
    "distortion_from_directions",
    "distortion_from_model",
    "distortion_index",
    "reward_conflicts",
    "term_directions",
]
