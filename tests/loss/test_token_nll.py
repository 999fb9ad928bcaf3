"""ringft.loss.tokens: per-token NLL and two models' KL / top-1 agreement in token chunks, against the
plain computation on full logits (``log_softmax`` of ``hidden @ W.T + b``).

Tolerances: in fp64 the chunked and the full computation do the same arithmetic per token (a chunk's
rows are independent), so they agree to a few ulps: ``rtol = eps64 * (vocab + hidden)``, the lengths
of the two reductions (log-sum-exp over the vocabulary, the logit dot products). In fp32 the oracle
is the same full computation in fp32 (equal per row up to the matmul's blocking), checked with
``eps32 * (vocab + hidden) * max|value|``. The per-token NLL must also be exactly the terms
:func:`ringft.loss.chunked_lm_loss` sums (same chunk size: bit-equal sum).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringft.loss import chunked_lm_loss, compare_next_token, head_parameters, token_nll

EPS64 = torch.finfo(torch.float64).eps
EPS32 = torch.finfo(torch.float32).eps


def _inputs(tokens=37, hidden=16, vocab=53, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, vocab, (tokens,), generator=gen)
    return h, w, b, y


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_nll_equals_full_logits(dtype):
    h, w, b, y = _inputs(dtype=dtype)
    expected = F.cross_entropy(F.linear(h, w, b).to(torch.float64), y, reduction="none")
    eps = EPS64 if dtype == torch.float64 else EPS32
    for chunk in (1, 5, 37, 100):
        got = token_nll(h, w, y, bias=b, chunk_size=chunk)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        bound = eps * (w.shape[0] + w.shape[1]) * expected.abs().max()
        assert (got.double() - expected).abs().max() <= bound


@pytest.mark.numerics
def test_token_nll_sums_to_the_chunked_loss():
    h, w, _, y = _inputs(dtype=torch.float32)
    total = chunked_lm_loss(h[None], w, y[None], num_items_in_batch=1, chunk_size=8)
    assert token_nll(h, w, y, chunk_size=8).sum().item() == pytest.approx(
        total.item(), rel=4 * EPS32 * len(y)
    )


@pytest.mark.numerics
def test_compare_next_token_equals_full_logits():
    ha, wa, ba, y = _inputs(seed=1)
    noise, _, _, _ = _inputs(seed=2)
    hb, wb = ha + 0.5 * noise, wa  # a nearby model: some top-1 tokens agree, some not
    got = compare_next_token(ha, wa, hb, wb, y, bias_a=ba, chunk_size=6)
    la = torch.log_softmax(F.linear(ha, wa, ba), -1)
    lb = torch.log_softmax(F.linear(hb, wb), -1)
    kl = (la.exp() * (la - lb)).sum(-1)
    torch.testing.assert_close(got.kl, kl, rtol=0, atol=64 * EPS64 * 53)
    assert torch.allclose(kl, F.kl_div(lb, la, log_target=True, reduction="none").sum(-1))
    torch.testing.assert_close(got.nll_a, -la.gather(1, y[:, None]).squeeze(1))
    torch.testing.assert_close(got.nll_b, -lb.gather(1, y[:, None]).squeeze(1))
    assert torch.equal(got.agree, la.argmax(-1) == lb.argmax(-1)) and 0 < got.agree.sum() < len(y)
    same = compare_next_token(ha, wa, ha, wa, y, bias_a=ba, bias_b=ba)
    assert same.kl.abs().max() <= 64 * EPS64 and bool(same.agree.all())


def test_bad_inputs_and_head_parameters():
    h, w, _, y = _inputs()
    with pytest.raises(ValueError, match="targets must be token ids"):
        token_nll(h, w, y + 100)
    with pytest.raises(ValueError, match="chunk_size"):
        token_nll(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match="vocabularies differ"):
        compare_next_token(h, w, h, w[:-1], y)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    weight, bias = head_parameters(model)
    assert weight is model.lm_head.weight and bias is None
