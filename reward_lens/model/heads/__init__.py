"""Reward heads: the scalar linear head and ArmoRM's gated multi-objective head."""
