"""What goes wrong reading a model's config.json."""

from __future__ import annotations


class ModelConfigError(ValueError):
    """config.json is missing, unreadable, or describes something Ferrum cannot run."""
