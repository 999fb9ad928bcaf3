"""The training data path: the CP collator, corpus packing (``pack_corpus``, ``packer``, ``corpus``),
Trainer / TRL batches for the ring (``hf_batch``), tokenizers (``tokenizer``), the longest input that
fits a token budget (``fit``), stable seeds (``seeds``) and line-retrieval records with the synthetic
training examples built from them (``line_retrieval``).

Only the collator and the packer (``packer.pack_rows``) are imported here (``pack_corpus`` and
``line_retrieval.training`` pull in ``datasets``).
"""

from ringft.data.collator import RingDataCollator, pad_and_shard
from ringft.data.packer import pack_rows

__all__ = ["RingDataCollator", "pack_rows", "pad_and_shard"]
