"""TopK / standard / JumpReLU sparse autoencoders in SAELens's format, trained on reward-model activations."""
