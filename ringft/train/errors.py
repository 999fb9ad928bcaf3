"""The errors a training run reports as one line (``ringft train: error: ...``), not a traceback."""

from __future__ import annotations

import errno

__all__ = ["RecipeError", "TrainError", "first_line", "io_error", "is_io_failure"]


class TrainError(RuntimeError):
    """A run that cannot start or go on, with what is wrong (the value, the path) and how to fix it.

    Raised on every rank that meets it; ``ringft train`` prints it as one line and exits with 2.
    """


class RecipeError(TrainError, ValueError):
    """A recipe (or its combination with the launch, the data, the checkpoints) that cannot run."""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when the message is empty)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    # torch.save reports a full disk as "PytorchStreamWriter failed writing file ...: file write
    # failed"; safetensors as "IoError(Os { code: 28, kind: StorageFull, ... })".
    return "No space left on device" in text or "StorageFull" in text or "file write failed" in text


def is_io_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed read/write (an ``OSError``, or a writer's report of a full disk)."""
    return isinstance(exc, OSError) or _is_disk_full(exc)


def io_error(what: str, path: object, exc: BaseException, kept: str = "") -> TrainError:
    """One-line :class:`TrainError` for a failed write of ``what`` at ``path``.

    A full disk (or quota) reads ``... no space left on device ...``; any other failure quotes the
    first line of the system's message. ``kept`` says what is still intact (e.g. the previous
    checkpoint), appended to the line.
    """
    if _is_disk_full(exc):
        reason = "no space left on device: free space (or raise the quota) and rerun"
    else:
        reason = f"{type(exc).__name__}: {first_line(exc)}"
    tail = f"; {kept}" if kept else ""
    return TrainError(f"writing {what} {path} failed: {reason}{tail}")
