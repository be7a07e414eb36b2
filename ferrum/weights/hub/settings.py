"""Where the Hugging Face source talks to and keeps files, read from the environment at each call.

huggingface_hub reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is first
imported; Ferrum reads them again on every call and passes them explicitly, so a value set after
import (a test, an embedding program) still counts. The token is left to huggingface_hub
(`HF_TOKEN`, then the token stored by `hf auth login`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants

__all__ = ["HubSettings", "hub_settings"]

_TRUE = {"1", "on", "yes", "true"}


@dataclass(frozen=True)
class HubSettings:
    endpoint: str  # e.g. https://huggingface.co, or a mirror
    cache_dir: Path  # huggingface_hub's cache: <cache_dir>/models--org--name/{blobs,snapshots,refs}
    offline: bool  # HF_HUB_OFFLINE: only what is already in the cache


def hub_settings(cache_dir: Path | None = None) -> HubSettings:
    """The settings now; `cache_dir` (a source's own) wins over HF_HUB_CACHE and HF_HOME."""
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    if cache_dir is None:
        if os.environ.get("HF_HUB_CACHE"):
            cache_dir = Path(os.environ["HF_HUB_CACHE"])
        elif os.environ.get("HF_HOME"):
            cache_dir = Path(os.environ["HF_HOME"]) / "hub"
        else:
            cache_dir = Path(constants.HF_HUB_CACHE)
    env_offline = os.environ.get("HF_HUB_OFFLINE")
    offline = env_offline.strip().lower() in _TRUE if env_offline is not None else constants.HF_HUB_OFFLINE
    return HubSettings(endpoint=endpoint, cache_dir=Path(cache_dir).expanduser(), offline=offline)
