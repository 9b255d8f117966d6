"""reward-lens: mechanistic interpretability for reward models, along the reward direction w_r.

The package, bottom layer first (each imports only from the layers before it; `tests/test_structure.py`):
`data/`, `stats`, `results`, `plotting` (shared by all) -> `model/` (the hooked reward model and its heads)
-> `converters/` (one weight map per architecture) -> `loading/` (checkpoints in and out) -> `core/`
(batching, readout capture, directions) -> `demo/` (the organisms) -> `instruments/` (lens, attribution,
patching, ...), `representations/` (SAEs, features, concepts, editing), `probes/`, `theory/` ->
`distributed` -> `integrations/` (TRL) -> `app/` (audit, report, compare, monitor, sweep, CLI).
This module is the public API, grouped by concept.
"""

from reward_lens.version import __version__

# The public API is imported on first use of one of its names (`reward_lens.HookedRewardModel`, `from
# reward_lens import lens`), not by `import reward_lens` itself: the command line parses its arguments and
# answers --help without loading torch. `_API` holds the import statements, run once, in this namespace.
_API = """
# The model: a TransformerLens-style hooked decoder whose unembed is a reward head.
from reward_lens.model.config import RewardModelConfig
from reward_lens.loading.native import HookedRewardModel  # the native model with its checkpoint I/O
from reward_lens.model.heads.scalar import RewardHead
from reward_lens.model.heads.armorm import ArmoRMHead  # registers the "armorm" head type
from reward_lens.model.heads import JudgeHead, MLPHead, ProcessRewardHead, QRMHead  # the other head types
from reward_lens.model.heads.base import read_objective, read_step
from reward_lens.model.generic.discovery import GenericLoadError, GenericPathError, GenericRewardModelConfig
from reward_lens.loading.generic import GenericHookedRewardModel
from reward_lens.loading.export import export_hf

# Preference data and the model organisms (models with planted, known preferences).
from reward_lens.data.pairs import PreferencePair, TokenPair, bundled_pairs, load_pairs
from reward_lens.demo import demo_pairs, load_demo_model
from reward_lens.demo.smollm2 import load_smollm2_organism, smollm2_pairs
from reward_lens.demo.organisms import (
    load_gate_organism,
    load_trigger_organism,
    planted_circuit,
    trigger_items,
)

# Instruments: where the preference crystallizes, what writes it (exact), what causes it (patching), which
# paths carry it (circuits), and which inputs inflate it (trigger search).
from reward_lens.instruments import (
    AtPComparison,
    AtPResult,
    AttributionResult,
    DivergenceResult,
    EdgeAttributionResult,
    EffectDecompositionResult,
    FaithfulnessCurve,
    FaithfulnessResult,
    LensResult,
    PatchResult,
    PathPatchResult,
    TokenAttributionResult,
    TriggerSearchResult,
    attribute,
    attribution_patch,
    circuit_faithfulness,
    divergence_patch,
    edge_attribution,
    effect_decomposition,
    faithfulness,
    faithfulness_curve,
    lens,
    patch,
    path_patch,
    search_triggers,
    token_attribution,
)
from reward_lens.instruments import AttributionGraph, FeatureGraph, attribution_graph  # one text
from reward_lens.instruments import FeatureExamples, feature_examples  # a feature's top activating texts
from reward_lens.instruments import ContrastiveFeatures, contrastive_features  # features: text vs control

# Representations: SAEs, SAE features along the reward direction, concept vectors, reward editing.
from reward_lens.representations.sae import SAEConfig, SAEMetrics, SparseAutoencoder, load_sae, train_sae
from reward_lens.representations.transcoders import (
    Transcoder,
    TranscoderMetrics,
    TranscoderSet,
    evaluate_transcoders,
    jumprelu_from_topk,
    load_transcoders,
    train_transcoders,
)
from reward_lens.representations.features import (
    FeatureAblation,
    FeatureAlignment,
    FeatureAttribution,
    feature_ablation,
    feature_alignment,
    feature_attribution,
)
from reward_lens.representations.concepts import (
    ConceptVector,
    ContrastPair,
    concept_vector,
    list_contrast_sets,
    load_contrast_set,
)
from reward_lens.representations.dose import DoseResponse, concept_effect, dose_response
from reward_lens.representations.editing import RewardEdit, edit_reward

# Behaviour: hacking probes, the theory-grounded analyses, cross-model comparison.
from reward_lens.probes.suite import ProbeItem, ProbeResult, probe_pairs, run_probes
from reward_lens.theory import (
    CascadeResult,
    ConflictResult,
    DistortionResult,
    detect_cascades,
    distortion_index,
    reward_conflicts,
)
from reward_lens.app.compare import ComparisonResult, ModelProfile, compare_models

# Benchmarks by their official rules: RewardBench 2, RM-Bench, JudgeBench, RewardBench v1.
from reward_lens.evaluation import BenchmarkResult, benchmark_pairs, evaluate
"""

__all__ = [
    # the model
    "ArmoRMHead",
    "GenericHookedRewardModel",
    "GenericLoadError",
    "GenericPathError",
    "GenericRewardModelConfig",
    "HookedRewardModel",
    "JudgeHead",
    "MLPHead",
    "ProcessRewardHead",
    "QRMHead",
    "RewardHead",
    "RewardModelConfig",
    "export_hf",
    "read_objective",
    "read_step",
    # data and organisms
    "PreferencePair",
    "TokenPair",
    "bundled_pairs",
    "demo_pairs",
    "load_demo_model",
    "load_pairs",
    "load_smollm2_organism",
    "smollm2_pairs",
    "load_gate_organism",
    "load_trigger_organism",
    "planted_circuit",
    "trigger_items",
    # instruments
    "AtPComparison",
    "AtPResult",
    "AttributionResult",
    "DivergenceResult",
    "FaithfulnessResult",
    "LensResult",
    "PatchResult",
    "PathPatchResult",
    "TokenAttributionResult",
    "attribute",
    "attribution_patch",
    "divergence_patch",
    "faithfulness",
    "lens",
    "patch",
    "path_patch",
    "token_attribution",
    "EdgeAttributionResult",
    "edge_attribution",
    "AttributionGraph",
    "FeatureGraph",
    "attribution_graph",
    "FeatureExamples",
    "feature_examples",
    "ContrastiveFeatures",
    "contrastive_features",
    "EffectDecompositionResult",
    "effect_decomposition",
    "FaithfulnessCurve",
    "circuit_faithfulness",
    "faithfulness_curve",
    "TriggerSearchResult",
    "search_triggers",
    # representations
    "ConceptVector",
    "ContrastPair",
    "DoseResponse",
    "FeatureAblation",
    "FeatureAlignment",
    "FeatureAttribution",
    "RewardEdit",
    "SAEConfig",
    "SAEMetrics",
    "SparseAutoencoder",
    "concept_effect",
    "concept_vector",
    "dose_response",
    "edit_reward",
    "feature_ablation",
    "feature_alignment",
    "feature_attribution",
    "list_contrast_sets",
    "load_contrast_set",
    "load_sae",
    "train_sae",
    "Transcoder",
    "TranscoderMetrics",
    "TranscoderSet",
    "evaluate_transcoders",
    "jumprelu_from_topk",
    "load_transcoders",
    "train_transcoders",
    # behaviour
    "CascadeResult",
    "ComparisonResult",
    "ConflictResult",
    "DistortionResult",
    "ModelProfile",
    "ProbeItem",
    "ProbeResult",
    "compare_models",
    "detect_cascades",
    "distortion_index",
    "probe_pairs",
    "reward_conflicts",
    "run_probes",
    # benchmarks
    "BenchmarkResult",
    "benchmark_pairs",
    "evaluate",
    "__version__",
]


def _load_api() -> None:
    """Run `_API`'s statements in this module (line numbers as in this file, for tracebacks)."""
    if "HookedRewardModel" not in globals():
        first_line = _source_line('_API = """')
        exec(compile("\n" * first_line + _API, __file__, "exec"), globals())


def _source_line(text: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, line in enumerate(f, 1) if line.startswith(text))


def __getattr__(name: str):
    if name in __all__:
        _load_api()
        return globals()[name]
    raise AttributeError(f"module 'reward_lens' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
