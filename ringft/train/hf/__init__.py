"""ringft inside ``transformers.Trainer`` and TRL's ``SFTTrainer``: :class:`RingTrainerMixin`.

Modules, one job each: ``mixin`` (the class: which Trainer methods it overrides), ``data``
(dataloaders over the DP group, batches sharded per CP rank, metrics gathered across DP),
``steps`` (the step's denominator, loss scale and token counters; refused batches raised on every
rank), ``forward`` (ringft's chunked loss through the wrapped model; eval and predict calls),
``checks`` (what is refused at construction), ``versions`` (the supported transformers / trl).
"""

from ringft.train.hf.mixin import RingTrainerMixin

__all__ = ["RingTrainerMixin"]
