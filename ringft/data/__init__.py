"""Data side: the CP collator, corpus packing, and line retrieval (``line_retrieval``: LongChat-style
records, their prompt text, cases, scoring, synthetic training examples and the demo tokenizer).

Only the collator is imported here (``packing`` and ``line_retrieval.training`` pull in ``datasets``).
"""

from ringft.data.collator import RingDataCollator, first_fit_decreasing, pad_and_shard

__all__ = ["RingDataCollator", "first_fit_decreasing", "pad_and_shard"]
