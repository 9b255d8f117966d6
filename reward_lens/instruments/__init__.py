"""The instruments: functions of (model, pairs, options) returning result dataclasses that follow the
result protocol (`reward_lens.results`: `.to_frame()`, `.summary()`, `.plot(ax=None)`). Every one reads
along the reward direction at the readout position."""

from reward_lens.instruments.sites import Site, component_sites, head_sites, resid_sites
from reward_lens.instruments.attribution import AttributionResult, attribute
from reward_lens.instruments.patching.atp import AtPComparison, AtPResult, attribution_patch
from reward_lens.instruments.divergence import DivergenceResult, PCAMahalanobis, divergence_patch
from reward_lens.instruments.faithfulness import FaithfulnessResult, faithfulness
from reward_lens.instruments.lens import LensResult, lens
from reward_lens.instruments.patching.contrastive import PatchResult, patch, site_means
from reward_lens.instruments.patching.path import PathPatchResult, path_patch
from reward_lens.instruments.tokens import TokenAttributionResult, token_attribution
from reward_lens.instruments.triggers import TriggerSearchResult, search_triggers

__all__ = [
    "AtPComparison", "AtPResult", "AttributionResult", "DivergenceResult", "FaithfulnessResult", "LensResult",
    "PCAMahalanobis", "PatchResult", "Site", "attribute", "attribution_patch", "component_sites",
    "divergence_patch", "faithfulness", "head_sites", "lens", "patch", "resid_sites", "site_means",
    "PathPatchResult", "TokenAttributionResult", "path_patch", "token_attribution",
    "TriggerSearchResult", "search_triggers",
]
