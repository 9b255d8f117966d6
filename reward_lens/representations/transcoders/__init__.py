"""Per-layer skip transcoders of a reward model's MLPs: `module` (the transcoder, the set, the disk format),
`families` (TopK, BatchTopK behind one registry), `train` (training on activations streamed from text,
held-out evaluation and the replacement model)."""

from reward_lens.representations.transcoders.families import FAMILIES
from reward_lens.representations.transcoders.module import (
    Transcoder,
    TranscoderMetrics,
    TranscoderSet,
    input_hook,
    load_transcoders,
    output_hook,
    replacement_hooks,
)
from reward_lens.representations.transcoders.train import evaluate_transcoders, train_transcoders

__all__ = [
    "FAMILIES",
    "Transcoder",
    "TranscoderMetrics",
    "TranscoderSet",
    "evaluate_transcoders",
    "input_hook",
    "load_transcoders",
    "output_hook",
    "replacement_hooks",
    "train_transcoders",
]
