"""Resumable eval results in ``--output``: one append-only ``results-dp<k>.jsonl`` per data-parallel
replica, one JSON record per finished case, and ``settings.json`` naming what the results depend on.

A record is reused only when both its case key (the case's cell, seed and a hash of its final
prompt) and its settings digest match the current run. The settings are everything that changes the
generated text: the model (path and its weight/config files' sizes and modification times), the
tokenizer (a hash of its serialization and chat template), ``max_new_tokens``, dtype and RoPE theta.
A folder holding other settings' results is refused, naming each difference. Not in the settings:
the scoring rule (records keep the generated text and are re-scored on every summary), and the
CP/DP layout and attention backend (they change results only by float round-off).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

SETTINGS_FILE = "settings.json"
RESULTS_GLOB = "results-dp*.jsonl"


class ResultsError(ValueError):
    """``--output`` holds results that cannot be reused (the message names the file or setting)."""


class ResultsWriteError(RuntimeError):
    """Writing into ``--output`` failed; the message names the path and the OS's reason."""


def write_error(path: Path, exc: OSError) -> ResultsWriteError:
    """One-line error for a failed write: ``cannot write PATH: no space left on device``."""
    reason = (exc.strerror or str(exc) or type(exc).__name__).lower()
    return ResultsWriteError(f"cannot write {path}: {reason}")


def tokenizer_identity(tokenizer: Any) -> str:
    """A hash of everything in the tokenizer that turns a prompt into ids: its serialized backend
    (vocabulary, merges, normalizer, special tokens) or vocabulary, and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps([getattr(tokenizer, "chat_template", None), tokenizer.all_special_tokens])
    return hashlib.sha256((body + extra).encode()).hexdigest()[:16]


def settings_digest(settings: dict[str, Any]) -> str:
    """Short stable hash of a settings mapping (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """``"dtype 'fp32' -> 'bf16'; weights: model.safetensors changed"`` for two settings mappings."""
    parts = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            files = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            parts.append(f"{name}: {', '.join(files)} changed")
        else:
            parts.append(f"{name} {before!r} -> {after!r}")
    return "; ".join(parts)


def read_results_file(path: Path) -> tuple[list[dict[str, Any]], int | None]:
    """Records of one results file, and the 1-based number of an incomplete last line (a write cut
    off before its newline; ignored) or None. ResultsError naming the file and line for any other
    line that is not a JSON record with a ``key``."""
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    partial = len(lines) if lines[-1] else None  # the text after the last newline, if any
    records = []
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            if not isinstance(record, dict) or "key" not in record or "settings" not in record:
                raise ValueError("not a result record (a JSON object with 'key' and 'settings')")
        except ValueError as exc:  # also UnicodeDecodeError and json.JSONDecodeError
            raise ResultsError(
                f"{path} line {number}: {exc}; delete that line (its case is then evaluated again)"
            ) from None
        records.append(record)
    return records, partial


class ResultsStore:
    """The results of one ``--output`` folder for one settings mapping (see the module doc)."""

    def __init__(self, folder: str | Path, settings: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self.settings = settings
        self.digest = settings_digest(settings)

    def results_files(self) -> list[Path]:
        """The replicas' results files present in the folder, sorted."""
        return sorted(self.folder.glob(RESULTS_GLOB)) if self.folder.is_dir() else []

    def load(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Finished records by case key, and one note per incomplete last line found. Reads only.
        ResultsError when the folder holds results of other settings (naming the differences) or
        a damaged line (naming file and line)."""
        done: dict[str, dict[str, Any]] = {}
        notes = []
        for path in self.results_files():
            records, partial = read_results_file(path)
            if partial is not None:
                notes.append(
                    f"{path} line {partial}: incomplete last line (an interrupted write) ignored; "
                    "it is removed and its case evaluated again"
                )
            for record in records:
                done[record["key"]] = record
        if not done:
            return done, notes
        settings_path = self.folder / SETTINGS_FILE
        try:
            saved = json.loads(settings_path.read_text())
        except FileNotFoundError:
            raise ResultsError(
                f"--output {self.folder} holds results but no {SETTINGS_FILE} (an older ringft "
                "wrote them): use another --output, or delete the folder to start over"
            ) from None
        except ValueError as exc:
            raise ResultsError(f"{settings_path}: {exc}; delete the folder to start over") from None
        if saved != self.settings:
            raise ResultsError(
                f"--output {self.folder} holds results of other settings "
                f"({describe_difference(saved, self.settings)}): use another --output, or delete "
                "the folder to start over"
            )
        stale = [r["key"] for r in done.values() if r["settings"] != self.digest]
        if stale:
            raise ResultsError(
                f"--output {self.folder}: {len(stale)} record(s) do not match {SETTINGS_FILE} "
                f"(e.g. {stale[0]}); delete the folder to start over"
            )
        return done, notes

    def prepare(self) -> None:
        """Main process, before any replica appends: create the folder, write ``settings.json``
        and cut incomplete last lines away. ResultsWriteError naming the path on failure."""
        path = self.folder
        try:
            path.mkdir(parents=True, exist_ok=True)
            path = self.folder / SETTINGS_FILE
            path.write_text(json.dumps(self.settings, indent=1, sort_keys=True) + "\n")
            for path in self.results_files():
                raw = path.read_bytes()
                if raw and not raw.endswith(b"\n"):
                    with path.open("r+b") as fh:
                        fh.truncate(raw.rfind(b"\n") + 1)
        except OSError as exc:
            raise write_error(path, exc) from None

    def append(self, dp_rank: int, record: dict[str, Any]) -> None:
        """Append one finished case (durably: flushed and fsync'ed) to ``results-dp<dp_rank>.jsonl``.
        ResultsWriteError naming the path and the reason (e.g. no space left on device)."""
        path = self.folder / f"results-dp{dp_rank}.jsonl"
        line = json.dumps({**record, "settings": self.digest}) + "\n"
        try:
            with path.open("a", encoding="utf-8") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise write_error(path, exc) from None
