"""The library version (read by pyproject.toml and written into every report)."""

__version__ = "0.1.0"
