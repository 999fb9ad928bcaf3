"""Stable seeds for generated text: the same parts give the same seed on every machine and run."""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]


def derive_seed(*parts: object) -> int:
    """Stable 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    key = "|".join(f"{p:.6f}" if isinstance(p, float) else str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1
