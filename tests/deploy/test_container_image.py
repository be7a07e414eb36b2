"""The CPU image, built from the real Dockerfile with podman and run as a container engine would run it:
scripts/check_container_image.py (its docstring lists the checks) must pass. Several minutes on a machine
whose cache of the debootstrap base image is empty; seconds after that."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.tools import ROOT, tool

MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_cpu_image_builds_serves_and_drains(tmp_path: Path) -> None:
    for name in ("podman", "buildah", "debootstrap"):
        tool(name)
    if not (MODEL / "config.json").exists():
        pytest.skip("the demo model is not prepared (`make model`)")
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_container_image.py"),
                          "--model", str(MODEL), "--report", str(report)],
                         capture_output=True, text=True, timeout=2300)
    print(res.stdout[-4000:])
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    measured = json.loads(report.read_text())
    assert measured["image_bytes"] < 1_500_000_000
    for run in ("local-model", "s3-model"):
        assert "Paris" in measured[run]["answer"] and measured[run]["exit_after_sigterm"] == 0
    assert measured["s3-model"]["cache_volume_bytes"] >= (MODEL / "model.safetensors").stat().st_size
