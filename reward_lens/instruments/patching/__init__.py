"""Contrastive activation patching (readout-aligned, KV-cache fast path) and attribution patching (AtP)."""

from reward_lens.instruments.patching.contrastive import MODES, POSITIONS, PatchResult, patch, site_means

__all__ = ["MODES", "POSITIONS", "PatchResult", "patch", "site_means"]
