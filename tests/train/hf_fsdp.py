"""(Helper of tests/train/test_hf_fsdp.py, run inside the 2-process spawn of
tests/train/conftest.py.) The mixin's training step under FSDP2 (``fully_shard``, what
accelerate's ``fsdp_version: 2`` applies) and FSDP1 on gloo CPU processes: CP ranks hold partial
gradients of one replica, and the step's loss scale turns FSDP's average over the world into the
one-process gradient.

accelerate runs FSDP only on accelerators (the mixin refuses an FSDP launch on CPU rather than
train unsharded), so the Trainer + accelerate FSDP launch (recipes/accelerate/fsdp2.yaml) is listed
in benchmarks/RESULTS.md, "Not yet measured on a GPU". Here the pieces the Trainer runs are driven
directly, on 2 ranks (dp=1 x cp=2), 2 micro-steps of 2 right-padded rows each, without ``no_sync``
(the mixin sets ``sync_each_batch`` under FSDP: every micro-step reduce-scatters, a rank never holds
unsharded gradients): the batches sharded by ``shard_collated_batch``, the step's count from
``exchange_step_counts``, the loss through the wrapped model (``ring_loss``) times ``loss_scale``.

Oracle: the unmodified model on one process, the 4 rows in one batch, full logits. Tolerance (as
tests/train/test_fsdp.py): the same fp32 math with sums reordered, eps32 x (tokens + vocab + hidden
+ intermediate) of the largest gradient entry of each tensor.

The same FSDP2 step on a tiny Qwen3-MoE (hf_runs.tiny_moe) and a tiny Mixtral (hidden 64,
intermediate 96, 4 experts, 2 per token), both with their router load-balancing loss on (coef
0.5): the experts and routers sharded over the 2 ranks; oracle: transformers' forward loss (token
loss + 0.5 x the term over the rows of the attention mask) of each micro-batch of 2 rows, summed
(as the Trainer sums micro-steps), and its gradients. Tolerance: RTOL with the larger model's
hidden and intermediate sizes, plus the router statistics, two means over layers x rows summed in
another order (2 x 2 layers x tokens x eps32).
"""

from __future__ import annotations

import functools

import torch

ROWS, LONGEST = 4, 40
RTOL = torch.finfo(torch.float32).eps * (ROWS * LONGEST + 1658 + 32 + 64)
MOE_RTOL = torch.finfo(torch.float32).eps * (ROWS * LONGEST + 1658 + 64 + 96 + 2 * 2 * ROWS * LONGEST)


def _rows() -> dict[str, torch.Tensor]:
    """4 right-padded rows (lengths 40, 31, 22, 13) with masked prompts, as DataCollatorForSeq2Seq."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.zeros(ROWS, LONGEST, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, n in enumerate((40, 31, 22, 13)):
        ids[i, :n] = torch.randint(3, 300, (n,), generator=gen)
        mask[i, :n] = 1
        labels[i, 3 * i : n] = ids[i, 3 * i : n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _wrap(model, version: int):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if version == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)


def _full_grads(wrapped, version: int) -> dict[str, torch.Tensor]:
    if version == 2:
        return {n: p.grad.full_tensor() for n, p in wrapped.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(wrapped, with_grads=True):
        return {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in wrapped.named_parameters()}


def fsdp_steps() -> dict:
    """Both FSDP versions' errors against the one-process gradients, and the gradient entries this
    rank held after each micro-step (needs a 2-rank process group)."""
    from ringft import apply_ring_attention
    from ringft.data.hf_batch import shard_collated_batch
    from ringft.ops.parallel import build_layout
    from ringft.train.hf.forward import install_ring_loss_forward, ring_loss
    from ringft.train.hf.steps import exchange_step_counts, loss_scale
    from tests.train.hf_runs import tiny_model, tokenizer

    tok = tokenizer()
    full = _rows()
    reference = tiny_model(tok, lora=False)
    reference(**full, use_cache=False).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    layout = build_layout(2)
    micro = [{k: v[2 * m : 2 * m + 2] for k, v in full.items()} for m in range(2)]
    out = {}
    for version in (2, 1):
        model = tiny_model(tok, lora=False)
        total = sum(p.numel() for p in model.parameters())
        apply_ring_attention(model, layout.cp_group, "torch")
        install_ring_loss_forward(model, chunk_size=16, offload_activations=False)
        wrapped = _wrap(model, version)
        batches = [shard_collated_batch(b, layout.cp_rank, 2, tok.pad_token_id) for b in micro]
        counts = exchange_step_counts(batches, layout, True, torch.device("cpu"))
        held = []
        for batch in batches:
            (ring_loss(wrapped, batch, counts.num_items) * loss_scale(layout, True)).backward()
            grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
            held.append(sum(g.to_local().numel() if version == 2 else g.numel() for g in grads))
        got = _full_grads(wrapped, version)
        errors = {n: ((got[n] - g).abs().max() / g.abs().max()).item() for n, g in expected.items()}
        out[version] = {"errors": errors, "held": held, "total": total}
    moe = {name: _moe_step(build, tok, layout, full, micro) for name, build in _moe_models(tok).items()}
    return {"versions": out, "moe": moe}


def _moe_models(tok) -> dict:
    """Builders of the MoE models of the module docstring (each call: the same seeded weights)."""
    from tests.model.family_models import windowed_model
    from tests.train.hf_runs import tiny_moe

    router = dict(vocab_size=len(tok), output_router_logits=True, router_aux_loss_coef=0.5)
    return {
        "qwen3_moe": lambda: tiny_moe(tok),
        "mixtral": lambda: windowed_model("mixtral", None, torch.float32, **router),
    }


def _moe_step(build, tok, layout, full: dict, micro: list[dict]) -> dict:
    """The MoE case of the module docstring for the model ``build()`` returns: the logged loss's
    and every gradient's relative error, the experts' / routers' placements and local shapes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from ringft import apply_ring_attention
    from ringft.data.hf_batch import shard_collated_batch
    from ringft.train.hf.forward import install_ring_loss_forward, ring_loss
    from ringft.train.hf.steps import exchange_step_counts, loss_scale

    items = int((full["labels"][:, 1:] != -100).sum())
    reference, want = build(), 0.0
    for batch in micro:  # transformers' own loss: token share + coef x aux of the micro-batch's rows
        loss = reference(**batch, num_items_in_batch=items, use_cache=False).loss
        loss.backward()
        want += loss.item()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    model = build()
    apply_ring_attention(model, layout.cp_group, "torch")
    install_ring_loss_forward(model, chunk_size=16, offload_activations=False)
    wrapped = _wrap(model, 2)
    batches = [shard_collated_batch(b, layout.cp_rank, 2, tok.pad_token_id) for b in micro]
    counts = exchange_step_counts(batches, layout, True, torch.device("cpu"))
    logged = torch.zeros(())
    for batch in batches:
        loss = ring_loss(wrapped, batch, counts.num_items)
        (loss * loss_scale(layout, True)).backward()
        logged += loss.detach()
    dist.all_reduce(logged)
    got = _full_grads(wrapped, 2)
    held = {
        n: {
            "placements": [str(x) for x in p.placements],
            "shape": list(p.shape),
            "local": list(p.to_local().shape),
        }
        for n, p in wrapped.named_parameters()
        if isinstance(p, DTensor) and (".mlp.experts." in n or ".mlp.gate." in n)
    }
    return {
        "loss": abs(logged.item() / want - 1),
        "values": (logged.item(), want),
        "errors": {n: ((got[n] - g).abs().max() / g.abs().max()).item() for n, g in expected.items()},
        "experts": held,
    }
