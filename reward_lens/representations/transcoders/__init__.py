"""Per-layer skip transcoders of a reward model's MLPs: `module` (the transcoder, the set, the disk format),
`families` (TopK, BatchTopK, JumpReLU behind one registry), `train` (training on activations streamed from
text, held-out evaluation and the replacement model), `formats` (circuit-tracer's and SAELens's files, read
and written at the level of tensors; `module` dispatches to them), `convert` (the TopK -> JumpReLU
conversion those tools need)."""

from reward_lens.representations.transcoders.convert import jumprelu_from_topk
from reward_lens.representations.transcoders.families import FAMILIES
from reward_lens.representations.transcoders.formats import save_circuit_tracer, save_saelens
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
    "jumprelu_from_topk",
    "load_transcoders",
    "output_hook",
    "replacement_hooks",
    "save_circuit_tracer",
    "save_saelens",
    "train_transcoders",
]
