"""The instruments: functions of (model, pairs, options) returning result dataclasses that follow the
result protocol (`reward_lens.results`: `.to_frame()`, `.summary()`, `.plot(ax=None)`). Every one reads
along the reward direction at the readout position. Each also has a spec (`LensSpec`, `PatchSpec`, ...)
for `reward_lens.core.pipeline.run_pipeline`, which runs several instruments over one set of clean passes."""

from reward_lens.instruments.attribution import AttributionResult, AttributionSpec, attribute
from reward_lens.instruments.circuits.attribution_graph import AttributionGraph, attribution_graph
from reward_lens.instruments.circuits.contrastive_features import ContrastiveFeatures, contrastive_features
from reward_lens.instruments.circuits.decomposition import (
    EffectDecompositionResult,
    EffectSpec,
    effect_decomposition,
)
from reward_lens.instruments.circuits.edges import EdgeAttributionResult, edge_attribution
from reward_lens.instruments.circuits.faithfulness_curve import (
    FaithfulnessCurve,
    circuit_faithfulness,
    faithfulness_curve,
)
from reward_lens.instruments.circuits.feature_examples import FeatureExamples, feature_examples
from reward_lens.instruments.circuits.feature_graph import FeatureGraph
from reward_lens.instruments.divergence import (
    DivergenceResult,
    DivergenceSpec,
    PCAMahalanobis,
    divergence_patch,
)
from reward_lens.instruments.faithfulness import FaithfulnessResult, faithfulness
from reward_lens.instruments.lens import LensResult, LensSpec, lens
from reward_lens.instruments.patching.atp import AtPComparison, AtPResult, AtPSpec, attribution_patch
from reward_lens.instruments.patching.contrastive import PatchResult, PatchSpec, patch, site_means
from reward_lens.instruments.patching.path import PathPatchResult, path_patch
from reward_lens.instruments.sites import Site, component_sites, head_sites, resid_sites
from reward_lens.instruments.tokens import TokenAttributionResult, TokenSpec, token_attribution
from reward_lens.instruments.triggers import TriggerSearchResult, search_triggers

__all__ = [
    "AtPComparison",
    "AtPResult",
    "AttributionResult",
    "DivergenceResult",
    "FaithfulnessResult",
    "LensResult",
    "PCAMahalanobis",
    "PatchResult",
    "Site",
    "attribute",
    "attribution_patch",
    "component_sites",
    "divergence_patch",
    "faithfulness",
    "head_sites",
    "lens",
    "patch",
    "resid_sites",
    "site_means",
    "PathPatchResult",
    "TokenAttributionResult",
    "path_patch",
    "token_attribution",
    # pipeline specs (`reward_lens.core.pipeline.run_pipeline`): several instruments, clean passes shared
    "AtPSpec",
    "AttributionSpec",
    "DivergenceSpec",
    "EffectSpec",
    "LensSpec",
    "PatchSpec",
    "TokenSpec",
    "EdgeAttributionResult",
    "edge_attribution",
    "EffectDecompositionResult",
    "effect_decomposition",
    "FaithfulnessCurve",
    "circuit_faithfulness",
    "faithfulness_curve",
    "TriggerSearchResult",
    "search_triggers",
    "AttributionGraph",
    "FeatureGraph",
    "FeatureExamples",
    "feature_examples",
    "attribution_graph",
    "ContrastiveFeatures",
    "contrastive_features",
]
