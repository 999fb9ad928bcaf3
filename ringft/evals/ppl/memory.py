"""Peak memory per rank of a perplexity evaluation on the ring (``ringft eval-ppl``).

One no-grad ring forward over ``S`` tokens with CP = ``cp`` leaves each rank ``s = S_pad / cp``
positions (``S_pad``: ``S`` rounded up to a multiple of ``2 cp``); nothing is kept between layers
but the residual stream, and the output head runs ``c = --chunk-size`` tokens at a time. With
``a`` bytes per value of the model dtype, hidden ``H``, MLP width ``I``, ``h``/``g`` query/key-value
heads of dimension ``d`` and vocabulary ``V``, the peak above the weights is the largest of three
phases (bytes):

- attention: ``s * (2 H a + (h + 2 g) d a + 2 h d a + 4 g d a + h d (4 + a))``: residual and
  normed input, q/k/v, RoPE's rotated copy and temporary, the ring's K/V double buffer, the fp32
  output accumulator and one block's output;
- MLP: ``s * (2 H a + 3 I a)``: residual and normed input, the gate activation, the up projection
  and their product;
- head: ``2 s H a + c V (8 + a')``: final and gathered hidden states, one chunk's fp32 logits and
  log-sum-exp temporary (``a' = a`` when the logits are first computed in a lower precision, else 0).

Plus ``16 S`` bytes of per-token fp64 vectors. The weights are the model's parameters x ``a``.
``benchmarks/bench_eval_memory.py`` compares it with the peak of a run.
"""

from __future__ import annotations

from typing import Any

GIB = 1 << 30


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def parameter_count(config: Any) -> int:
    """Parameters of a LLaMA-like decoder from its config (embeddings, attention, gated MLP, norms,
    an untied head)."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = _get(config, "num_key_value_heads", heads)
    dim = _get(config, "head_dim", hidden // heads)
    vocab = config.vocab_size
    attention = hidden * dim * (2 * heads + 2 * kv)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if _get(config, "tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + layers * per_layer + hidden + head


def ppl_peak_memory(config: Any, seq_len: int, cp: int, dtype_bytes: int, chunk_size: int) -> dict[str, int]:
    """The terms of the module doc for one rank, in bytes: ``weights``, ``attention``, ``mlp``,
    ``head``, ``vectors`` and ``peak`` = weights + max(attention, mlp, head) + vectors."""
    a = dtype_bytes
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = _get(config, "num_key_value_heads", heads)
    dim = _get(config, "head_dim", hidden // heads)
    padded = -(-seq_len // (2 * cp)) * 2 * cp
    s = padded // cp
    attention = s * (
        2 * hidden * a
        + (heads + 2 * kv) * dim * a
        + 2 * heads * dim * a
        + 4 * kv * dim * a
        + heads * dim * (4 + a)
    )
    mlp = s * (2 * hidden * a + 3 * inter * a)
    chunk = min(chunk_size, s)
    head = 2 * s * hidden * a + chunk * config.vocab_size * (8 + (a if a < 4 else 0))
    terms = {
        "weights": parameter_count(config) * a,
        "attention": attention,
        "mlp": mlp,
        "head": head,
        "vectors": 16 * seq_len,
    }
    terms["peak"] = terms["weights"] + max(attention, mlp, head) + terms["vectors"]
    return terms


def describe_peak(config: Any, seq_len: int, cp: int, dtype_bytes: int, chunk_size: int) -> str:
    """One line: the estimated peak per rank and its largest phase."""
    t = ppl_peak_memory(config, seq_len, cp, dtype_bytes, chunk_size)
    phase = max(("attention", "mlp", "head"), key=lambda k: t[k])
    return (
        f"estimated peak memory per rank at {seq_len} tokens, cp {cp}: {t['peak'] / GIB:.2f} GiB "
        f"(weights {t['weights'] / GIB:.2f} GiB + {phase} phase {t[phase] / GIB:.2f} GiB; formula in "
        "ringft.evals.ppl.memory)"
    )
