"""Circuits of contrastive pairs: edge attribution, circuit faithfulness, and the effect decomposition."""
