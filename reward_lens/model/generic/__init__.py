"""The generic component-level path for any transformers *ForSequenceClassification reward model."""
