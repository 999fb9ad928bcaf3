"""Data side: the CP collator, corpus packing, line retrieval (``line_retrieval``: LongChat-style
records, their prompt text, cases, scoring, synthetic training examples and the demo tokenizer) and
the long-context evaluation tasks (``long_tasks``: LongLoRA's passkey, RULER's synthetic tasks, their
scoring and effective length).

Only the collator and the packer (``packer.pack_rows``) are imported here (``packing`` and
``line_retrieval.training`` pull in ``datasets``).
"""

from ringft.data.collator import RingDataCollator, pad_and_shard
from ringft.data.packer import pack_rows

__all__ = ["RingDataCollator", "pack_rows", "pad_and_shard"]
