"""Data side: the CP collator, corpus packing and synthetic training records.

Only the collator is imported here (``packing`` and ``synthetic`` pull in ``datasets``).
"""

from ringft.data.collator import RingDataCollator

__all__ = ["RingDataCollator"]
