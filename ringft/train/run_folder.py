"""The files of a run's output folder that are ringft's own: an exclusive lock for the run's
lifetime (``.ringft.lock``) and ``metrics.jsonl`` (:class:`ringft.train.front_runs.RunFolder` uses both).

Both are the main process's business (the other ranks never write here). Nothing is created before
the run's inputs have been checked: a refused recipe leaves no folder behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any

from ringft.train.errors import io_error

__all__ = ["LOCK_FILE", "METRICS_FILE", "MetricsFile", "OutputDirLock"]

LOCK_FILE = ".ringft.lock"
METRICS_FILE = "metrics.jsonl"


class OutputDirLock:
    """An exclusive ``fcntl.flock`` on ``output_dir/.ringft.lock``, held until :meth:`release` or the
    process ends (the kernel drops it when the process dies, even on SIGKILL)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None
        self.unsupported: str | None = None  # why the folder could not be locked (then unlocked)

    def acquire(self) -> str | None:
        """Take the lock (creating the folder). Returns None, or the one-line reason it is held.

        A file system without ``flock`` support (some network mounts) is not an error: the run goes
        on unlocked and the returned line is None; :attr:`unsupported` says why.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise io_error("the lock file", self.path, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return (
                    f"checkpoint.output_dir {str(self.path.parent)!r} is in use by another ringft run (it "
                    "holds "
                    f"{LOCK_FILE}): wait for that run to end or stop it (orphaned workers included), or "
                    "choose "
                    "another checkpoint.output_dir"
                )
            self.unsupported = (
                f"cannot lock {self.path} ({exc.strerror}): runs in this folder are not kept apart"
            )
            return None
        self._fd = fd
        return None

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class MetricsFile:
    """``output_dir/metrics.jsonl``: one JSON object per logged step (``{"step": n, ...}``)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / METRICS_FILE

    def append(self, row: dict[str, Any]) -> None:
        """Append one row (one line)."""
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as exc:
            raise io_error("metrics", self.path, exc) from exc

    def truncate_after(self, step: int) -> int:
        """Drop the rows of steps after ``step`` (logged after the checkpoint a run resumes from, and
        logged again by the resumed run), and an incomplete last line. Returns the rows dropped.

        Rewritten atomically (a new file, then one rename): a crash here keeps the old file.
        """
        if not self.path.is_file():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line cut by a crash mid-write
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
                dropped += 1
            else:
                kept.append(line)
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.write_text("".join(line + "\n" for line in kept))
                os.replace(tmp, self.path)
            except OSError as exc:
                raise io_error("metrics", self.path, exc) from exc
        return dropped

    def restart(self) -> None:
        """Remove the file (a fresh run in this folder starts a fresh log)."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            raise io_error("metrics", self.path, exc) from exc
