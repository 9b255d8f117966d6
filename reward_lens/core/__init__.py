"""What the instruments stand on: batching and padding, readout capture, per-sequence reward directions."""
