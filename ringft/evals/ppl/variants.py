"""The variants eval-ppl evaluates a document with: the model (``model``), the base model in full
(``baseline``) and the base model limited to its native window (``baseline-window``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringft.evals.figures import model_name

#: Variants: (name, role, windowed).
MODEL, BASELINE, WINDOW = "model", "baseline", "baseline-window"


def _resolved(path: str) -> str:
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def same_model(opts: Any) -> bool:
    """Whether ``--baseline`` names ``--model`` itself (no RoPE override): its full evaluation is
    then the model's own, and only the windowed one is added."""
    return opts.rope_theta is None and _resolved(opts.baseline) == _resolved(opts.model)


def variant_label(variant: str, opts: Any, window: int | None) -> str:
    """A variant's name in tables and figures (``window``: the native window's tokens)."""
    if variant == MODEL:
        return model_name(opts.model)
    base = model_name(opts.baseline)
    if variant == BASELINE:
        return f"{base} (base)"
    return f"{base} ({'' if same_model(opts) else 'base, '}sliding {window if window is not None else '?'})"
