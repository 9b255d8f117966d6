"""TopK / standard / JumpReLU sparse autoencoders in SAELens's format, trained on reward-model activations:
`module` (the SAE and its metrics), `saelens` (the disk format), `train` (TopK training)."""

from reward_lens.representations.sae.module import SAEMetrics, SparseAutoencoder, hook_width, load_sae
from reward_lens.representations.sae.saelens import (
    ARCHITECTURES,
    SAE_CFG_FILENAME,
    SAE_WEIGHTS_FILENAME,
    SPARSITY_FILENAME,
    TRAINING_FILENAME,
    SAEConfig,
)
from reward_lens.representations.sae.train import gather_activations, topk_losses, train_sae

__all__ = [
    "ARCHITECTURES",
    "SAEConfig",
    "SAEMetrics",
    "SAE_CFG_FILENAME",
    "SAE_WEIGHTS_FILENAME",
    "SPARSITY_FILENAME",
    "SparseAutoencoder",
    "TRAINING_FILENAME",
    "gather_activations",
    "hook_width",
    "load_sae",
    "topk_losses",
    "train_sae",
]
