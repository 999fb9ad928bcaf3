"""The transformers / TRL versions the mixin is tested with, checked when a trainer is built.

The mixin overrides private ``Trainer`` methods (``_get_dataloader``, ``_get_num_items_in_batch``,
``_track_num_input_tokens``) and reads TRL's metric bookkeeping; their behaviour changes between
minor releases, so an untested version is refused rather than run. The ranges are setup.cfg's
``install_requires``: ``pip install ringft`` resolves a supported set.
"""

from __future__ import annotations

import importlib.metadata

from packaging.version import Version

__all__ = ["SUPPORTED", "check_versions", "install_command"]

# package -> (lowest supported, first unsupported)
SUPPORTED = {"transformers": ("5.24", "5.25"), "trl": ("1.16", "1.17")}


def _installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_command() -> str:
    """The pip command that installs a supported transformers + trl set."""
    pins = " ".join(f"'{package}>={low},<{high}'" for package, (low, high) in SUPPORTED.items())
    return f"pip install {pins}"


def check_versions(uses_trl: bool) -> None:
    """Raise ``RuntimeError`` naming the package, its version and the supported range when the
    installed transformers (and, for a TRL trainer, trl) is outside :data:`SUPPORTED`."""
    for package in ("transformers", "trl") if uses_trl else ("transformers",):
        low, high = SUPPORTED[package]
        found = _installed(package)
        if found is None or not Version(low) <= Version(Version(found).base_version) < Version(high):
            raise RuntimeError(
                f"ringft.RingTrainerMixin is tested with {package}>={low},<{high} but {found or 'none'} is "
                f"installed (it overrides private Trainer methods that change between releases): "
                f"{install_command()}"
            )
