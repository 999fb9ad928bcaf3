"""Data side: the CP collator, corpus packing and synthetic training records.

Only the collator is imported here (``packing`` and ``synthetic`` pull in ``datasets``).
"""

from ringft.data.collator import RingDataCollator, first_fit_decreasing, pad_and_shard

__all__ = ["RingDataCollator", "first_fit_decreasing", "pad_and_shard"]
