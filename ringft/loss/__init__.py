"""The causal-LM loss: chunked ``lm_head`` + cross-entropy, and its normalisation over DP x CP x
gradient-accumulation micro-steps.

- :mod:`ringft.loss.chunked`: :func:`chunked_lm_loss`, the fused chunked loss (no full logits);
- :mod:`ringft.loss.head`: :func:`lm_loss_from_hidden` with a model's own ``lm_head`` (plain,
  ZeRO-3-partitioned, LoRA-adapted or sharded), :func:`checkpointed_head_loss`,
  :func:`output_projection`;
- :mod:`ringft.loss.normalization`: :func:`loss_normalization`, the step's denominator and loss
  scale, shared by the trainer and hand-written loops;
- :mod:`ringft.loss.tokens`: :func:`token_nll` and :func:`compare_next_token`, per-token NLL and
  two models' KL / top-1 agreement in token chunks (the evaluations' perplexity path);
- :mod:`ringft.loss.module`: :class:`CausalLMLoss`, a model wrapped as ``batch -> loss share``, and
  :func:`causal_lm_loss`, the same as a function (what ``ringft.RingTrainerMixin`` runs).
"""

from ringft.loss.chunked import chunked_lm_loss
from ringft.loss.head import checkpointed_head_loss, lm_loss_from_hidden, output_projection
from ringft.loss.module import CausalLMLoss, causal_lm_loss
from ringft.loss.normalization import LossNormalization, count_valid_targets, loss_normalization
from ringft.loss.tokens import TokenComparison, compare_next_token, head_parameters, token_nll

__all__ = [
    "CausalLMLoss",
    "LossNormalization",
    "causal_lm_loss",
    "TokenComparison",
    "checkpointed_head_loss",
    "chunked_lm_loss",
    "compare_next_token",
    "count_valid_targets",
    "head_parameters",
    "lm_loss_from_hidden",
    "loss_normalization",
    "output_projection",
    "token_nll",
]
