"""Plans as text: one plan's per-rank breakdown, and a table of layouts (GiB per rank)."""

from __future__ import annotations

from collections.abc import Sequence

from ringft.planner.setup import GIB, MemoryPlan

__all__ = ["format_layouts", "format_plan"]


def _gib(n: int) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GIB:.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """A readable per-rank breakdown of one plan (GiB)."""
    m, s = plan.model, plan.setup
    mode = f"LoRA r={s.lora_rank} ({','.join(s.lora_targets)})" if s.lora else "full fine-tuning"
    loss = f"chunked loss (chunk {s.loss_chunk_size})" if s.chunked_loss else "unchunked loss (full logits)"
    split = f" (ulysses {s.ulysses_size} x ring {s.ring_size})" if s.ulysses_size > 1 else ""
    windowed = [w for w in m.windows if w is not None]
    window = (
        f"; sliding window {'/'.join(str(w) for w in sorted(set(windowed)))} on {len(windowed)} of "
        f"{m.layers} layers (fewer attention FLOPs, same memory)"
        if windowed
        else ""
    )
    kinds = "".join(
        [
            f" v_head_dim={m.v_dim}" if m.v_dim != m.head_dim else "",
            f" global_head_dim={m.global_head_dim}" if m.global_head_dim else "",
            f" kv_shared_layers={m.kv_shared_layers}" if m.kv_shared_layers else "",
            f" Gated DeltaNet layers={len(m.linear_layers)}" if m.linear_layers else "",
        ]
    )
    lines = [
        f"model {m.name}: h={m.hidden} i={m.intermediate} L={m.layers} heads={m.heads} kv_heads={m.kv_heads} "
        f"head_dim={m.head_dim}{kinds} V={m.vocab}{' (tied)' if m.tie_embeddings else ''}; "
        f"{plan.params_total / 1e9:.3f}B params, {plan.params_trainable / 1e6:.1f}M trainable{window}",
        f"layout: {s.num_gpus} GPUs = dp {s.dp_size} x cp {s.cp_size}"
        f"{split}; S={s.seq_len} -> "
        f"{s.seq_local} tokens/rank x micro-batch {s.micro_batch_size}; {s.dtype}, {mode}, "
        f"ZeRO-{s.zero_stage}, offload {s.offloads}, {loss}, "
        f"{f'tiled MLP ({s.tiled_mlp_tokens or m.hidden} tokens/tile), ' if s.tiled_mlp else ''}"
        f"{'fused' if s.fused_rmsnorm else 'autograd'} RMSNorm backward"
        f"{f' ({s.tiled_norm_tokens} tokens/tile)' if s.tiled_norm_tokens else ''}, "
        f"{f'attention tiles of {s.attention_tile_tokens} tokens, ' if s.attention_tile_tokens else ''}"
        f"attention {s.attention_checkpoint}, "
        f"{'per-layer checkpointing' if s.gradient_checkpointing else 'no checkpointing'}",
        "",
        f"{'per rank':<34}{'GiB':>10}",
        f"{'  weights':<34}{_gib(plan.weights):>10}",
        f"{'  grads':<34}{_gib(plan.grads):>10}",
        f"{'  optimizer states':<34}{_gib(plan.optimizer):>10}",
        f"{'  ZeRO-3 gather buffers':<34}{_gib(plan.zero3_gather):>10}",
        f"{'  checkpointed activations':<34}{_gib(plan.checkpointed_activations):>10}",
        f"{'  one-layer recompute working set':<34}{_gib(plan.layer_working_set):>10}",
        f"{'  loss / logits working set':<34}{_gib(plan.loss_working_set):>10}",
        f"{'  framework overhead':<34}{_gib(plan.overhead):>10}",
        f"{'peak = states + ckpt + max(ws) + ovh':<34}{_gib(plan.total):>10}"
        f"   of {s.gpu_mem_gib:g} GiB -> {'FITS' if plan.fits else 'DOES NOT FIT'}"
        f" ({'+' if plan.headroom >= 0 else '-'}{_gib(abs(plan.headroom))} GiB)",
    ]
    d = plan.details
    parts = [(k.split(".", 1)[1], v) for k, v in d.items() if k.startswith("host.") and v]
    lines.append(
        f"{'host memory (CPU RAM) per GPU':<34}{_gib(plan.cpu_offloaded):>10}"
        + (" (" + ", ".join(f"{k} {_gib(v)}" for k, v in parts) + " GiB)" if parts else "")
    )
    lines += [
        "",
        "layer working set: MLP phase {} GiB, norm phase {} GiB, attention phase {} GiB "
        "(ring buffers {} GiB{})".format(
            _gib(d["layer_ws.mlp_phase"]),
            _gib(d["layer_ws.norm_phase"]),
            _gib(d["layer_ws.attention_phase"]),
            _gib(d["layer_ws.ring_buffers"]),
            f", all-to-all buffers {_gib(d['layer_ws.all_to_all_buffers'])} GiB"
            if s.ulysses_size > 1
            else "",
        ),
    ]
    return "\n".join(lines)


def format_layouts(plans: Sequence[MemoryPlan]) -> str:
    """A table with one row per plan (GiB per rank)."""
    head = (
        f"{'cp':>3} {'dp':>3} {'tok/rank':>9} {'offload':>15} {'weights':>8} {'grads':>7} {'optim':>7} "
        f"{'z3buf':>6} {'ckpt':>7} {'layer':>7} {'loss':>7} {'total':>8}  fits"
    )
    rows = [head, "-" * len(head)]
    for p in plans:
        s = p.setup
        rows.append(
            f"{s.cp_size:>3} {s.dp_size:>3} {s.tokens:>9} {s.offloads:>15} {_gib(p.weights):>8} "
            f"{_gib(p.grads):>7} {_gib(p.optimizer):>7} {_gib(p.zero3_gather):>6} "
            f"{_gib(p.checkpointed_activations):>7} {_gib(p.layer_working_set):>7} "
            f"{_gib(p.loss_working_set):>7} {_gib(p.total):>8}  {'yes' if p.fits else 'no'}"
        )
    return "\n".join(rows)
