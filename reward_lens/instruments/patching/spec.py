"""What a patching sweep asks for: the modes (which run is patched with what), the position choices and
methods, checked in one place with actionable errors.

    noising    chosen   <- rejected's activation
    denoising  rejected <- chosen's activation
    zero       chosen and rejected <- 0
    mean       chosen and rejected <- the mean activation over the pairs given
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

MODES = ("noising", "denoising", "zero", "mean")
POSITIONS = ("readout", "prompt", "all")
METHODS = ("fast", "naive")
# mode -> the runs it patches; mode -> the run its values come from (contrastive modes only)
TARGETS: Dict[str, Tuple[str, ...]] = {
    "noising": ("chosen",),
    "denoising": ("rejected",),
    "zero": ("chosen", "rejected"),
    "mean": ("chosen", "rejected"),
}
SOURCE: Dict[str, str] = {"noising": "rejected", "denoising": "chosen"}


def check_options(modes: Sequence[str], positions: str, method: str) -> None:
    if not modes:
        raise ValueError(f"no patching mode given (mode={list(modes)!r}); use one or more of {MODES}")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown patching mode(s) {bad}; use {MODES}")
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions {positions!r}; use one of {POSITIONS}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use 'fast' or 'naive'")
