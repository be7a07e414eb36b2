"""Every script under scripts/ compiles: most run only on machines CI does not have (GPUs, a device
session), so a syntax error there would otherwise wait for the next benchmark run to show."""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_compiles(script: Path, tmp_path: Path) -> None:
    py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)
