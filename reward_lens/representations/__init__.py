"""Representations along the reward direction: SAEs and their features, concept vectors, reward editing."""
