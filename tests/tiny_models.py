"""Tiny transformers models for the tests, importable by spawned ranks (plain functions, no fixtures).

- :func:`tiny_model`: a 2-layer LLaMA / Mistral of hidden 64 and vocabulary :data:`VOCAB`, seeded,
  eager attention (the one-process oracle of the ring tests);
- :func:`ragged_examples`: three examples of ragged lengths over that vocabulary, one with a masked
  prompt;
- :func:`save_tiny_model`: a 1-layer LLaMA with the shipped "demo" tokenizer, saved as a pretrained
  folder (what ``ringft eval-lines`` and ``RingInference`` load);
- :func:`compare_with_reference`: a CP rank's run of a patched model against the one-process model;
- :func:`document_examples` / :func:`documents_reference`: packed-document examples and each
  document alone through the unmodified model;
- :func:`saved_bytes`: the bytes autograd saves for the backward while a function runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96  # tiny_model's vocabulary (the log-sum-exp's reduction length in tolerances)
# The tiny decoder's config, shared with tests/model/family_models.py (every family's tiny model).
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_model(kind: str, **overrides):
    """A seeded 2-layer ``"llama"`` or ``"mistral"`` causal LM (:data:`TINY`: hidden 64, intermediate
    96, 4 heads, 2 KV heads, 512 positions), eager attention; ``overrides`` replace config values."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    common = {**TINY, "attn_implementation": "eager", **overrides}
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    common.setdefault("sliding_window", None)
    return MistralForCausalLM(MistralConfig(**common))


def ragged_examples(seed: int, lengths=(37, 50, 29)) -> list[dict[str, list[int]]]:
    """``{"input_ids", "labels"}`` examples of ``lengths`` tokens in ``1..VOCAB-1``; the second one's
    first half is a prompt (labels -100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        labels = list(ids)
        if i == 1:
            labels[: n // 2] = [-100] * (n // 2)  # a prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def save_tiny_model(path: Path, vocab_size: int | None = None, max_positions: int = 1024) -> None:
    """A 1-layer random LLaMA with the demo tokenizer, saved with save_pretrained (a few 100 KB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft.data.tokenizer import load_demo_tokenizer

    tok = load_demo_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab_size or len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
        )
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)


def fp32_bounds(seq: int) -> tuple[float, float, float]:
    """``(logits, loss, grad)`` relative fp32 bounds of :func:`tiny_model` runs over ``<= seq`` keys.

    Per layer q/k/v (hidden 64) + attention (<= ``seq`` keys) + o_proj (64) + gate/up (64) + down
    (96), 2 layers, then lm_head (64): the longest chain of fp32 sums behind one logit (``path``).
    Logits: ``path * eps`` of max |logit|; loss: ``+`` the log-sum-exp over VOCAB and the mean over
    ``<= seq`` targets; gradients: the backward retraces the path (``2 * path * eps`` of the
    parameter's max entry).
    """
    eps = torch.finfo(torch.float32).eps
    hidden, inter, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    path = layers * (hidden + seq + hidden + hidden + inter) + hidden
    return path * eps, (path + VOCAB + seq) * eps, 2 * path * eps


def compare_with_reference(model, ref, batch, full, rank, world, tag, group=None) -> dict[str, float]:
    """A CP rank's ``model(**batch)`` (loss, logits gathered over the group, gradients summed over
    it) against the one-process ``ref`` on the whole ``full`` batch: absolute loss and logits
    errors, and the largest gradient error relative to each parameter's largest entry. ``group``: the
    CP group (default: the world)."""
    import torch.distributed as dist

    from ringft import cp_gather

    out = model(**batch)
    out.loss.backward()
    n = int((full["shift_labels"] != -100).sum())
    ref_out = ref(
        input_ids=full["input_ids"],
        labels=full["shift_labels"],
        shift_labels=full["shift_labels"],
        num_items_in_batch=n,
    )
    ref_out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    logits = cp_gather(out.logits.detach(), group=group)
    errors = {
        f"{tag}/loss": (loss - ref_out.loss).abs().item(),
        f"{tag}/logits": (logits - ref_out.logits).abs().max().item(),
    }
    worst = 0.0
    trained = [(n_, p) for n_, p in model.named_parameters() if p.requires_grad]
    ref_trained = [(n_, p) for n_, p in ref.named_parameters() if p.requires_grad]
    assert [a for a, _ in trained] == [a for a, _ in ref_trained] and trained
    for (_, p), (_, pr) in zip(trained, ref_trained):
        grad = p.grad.detach().clone()
        dist.all_reduce(grad, group=group)  # each CP rank holds a partial gradient of the same replica
        worst = max(worst, ((grad - pr.grad).abs().max() / pr.grad.abs().max().clamp_min(1e-12)).item())
    errors[f"{tag}/grad"] = worst
    return errors


def document_examples(lengths: list[int], seed: int) -> list[dict]:
    """Random documents of ``lengths`` tokens in ``1..VOCAB-1``; every third (from the second) has
    its first half as a prompt (labels -100)."""
    import random

    gen = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = [gen.randrange(1, VOCAB) for _ in range(n)]
        labels = list(ids)
        if i % 3 == 1 and n > 2:
            labels[: n // 2] = [-100] * (n // 2)  # an SFT prompt that is not trained on
        out.append({"input_ids": ids, "labels": labels})
    return out


def documents_reference(ref, examples) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each document alone through the unmodified model; loss = all token losses / all targets."""
    total = sum(sum(x != -100 for x in ex["labels"][1:]) for ex in examples)
    logits, loss = [], torch.zeros(())
    for ex in examples:
        ids = torch.tensor([ex["input_ids"]])
        shift = torch.tensor([ex["labels"][1:] + [-100]])
        out = ref(input_ids=ids, labels=shift, shift_labels=shift, num_items_in_batch=total)
        logits.append(out.logits[0].detach())
        loss = loss + out.loss
    loss.backward()
    return logits, loss.detach()


def saved_bytes(run) -> int:
    """Bytes of every tensor autograd saves for the backward while ``run()`` executes (views and
    repeated saves counted each time)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total
