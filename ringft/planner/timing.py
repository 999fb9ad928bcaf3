"""Step-time model for the context-parallel layouts: ring, Ulysses and Ulysses x ring (hybrid).

Per rank and decoder layer, for ``cp = U x R`` (``U`` Ulysses, ``R`` ring), ``S`` tokens,
micro-batch ``B``, ``H`` query / ``H_kv`` K/V heads of dim ``d``, ``a`` bytes per element:

- **attention compute** (causal): forward ``2 B S^2 H d`` FLOP, backward 2.5x that (flash
  attention's recomputation), split evenly over the ``cp`` ranks (zigzag balance). A kernel call
  runs at ``attn_tflops / (1 + (c0 / c)^alpha)`` where ``c`` is the key length of its blocks:
  ``S/(2R)`` per ring step (a zigzag chunk), ``S`` for one whole-sequence call (``R = 1``): the
  per-tile prologue/epilogue and the ring's fp32 merge of each step's output are amortised over the
  keys. ``attn_tflops``, ``c0`` and ``alpha`` are fitted to the H100 measurements recorded in
  benchmarks/RESULTS.md (:data:`H100_ATTENTION`: every point within 2 %; ring step efficiency at
  N = 8, 128K: 93.3 % predicted vs 93.5 % measured). A call with fewer query tiles (``B * H/U *
  rows / 128``) than the GPU has SMs runs that much slower. All those points have ``U = 1, H = 32``:
  that heads do not matter otherwise (more keys per head for ``U > 1`` help) is an assumption.
- **ring** (zigzag, :mod:`ringft.ops.zigzag`): forward ``R - 1`` K/V sends of ``2 B (S/R) (H_kv'/U)
  d a`` bytes, each overlapped with one step's compute: ``(R-1) max(c_f, t_kv) + c_f``; backward
  ``R - 1`` K/V sends plus ``R`` sends of the fp32 dK/dV accumulators, the last one exposed.
- **Ulysses** (:mod:`ringft.ops.ulysses`): forward one all-to-all of q, k and v together (``B (S/cp)
  (H + 2 H_kv') d a`` bytes per rank, ``(U-1)/U`` of it leaves the rank) and one of the output
  (``B (S/cp) H d a``); backward the same two in reverse. Not overlapped with compute.
  ``H_kv' = lcm(H_kv, U)``: K/V heads replicated when ``U`` does not divide them.
- a link's time is ``bytes / bandwidth + latency``; a group whose ranks span nodes runs at the
  inter-node bandwidth (one NIC per GPU), the slowest link setting every synchronous step.
- **linear layers**: ``6 B (S/cp) P_layer`` FLOP (full fine-tuning) at ``matmul_tflops``, the LM
  head ``6 B (S/cp) V h``; identical for every layout of one ``cp``. With gradient checkpointing the
  layer's forward (communication included) runs twice. LoRA: the frozen weights get no weight
  gradient, ``4`` instead of ``6`` (the adapters' rank-``r`` products are not counted); the tiled
  MLP recomputes the MLP's forward once more in its backward.
- **layer kinds** (:meth:`ModelShape.layer_views`): each term is summed over the layers, each at
  its own sizes (Gemma 4's local and global head dims; latent attention's K/V at ``d + dv`` per head
  on the ring and ``B S^2 H (d + dv)`` forward FLOP); a MoE layer's matmuls count the experts one
  token runs. A Gated DeltaNet layer has no attention and no ring K/V: its chunked delta rule
  (:func:`ringft.planner.mixers.linear_flops`) runs at ``matmul_tflops`` and its state / halo
  exchanges (:func:`ringft.planner.mixers.linear_exchange_seconds`) are not overlapped (both
  unmeasured).
- **attention checkpoint** (``save`` / ``offload``): the recompute skips the attention forward
  (one attention forward per layer less; the offload's host copies are assumed hidden).
- **memory-bound kernels** (norms, RoPE, SwiGLU, residual adds, casts, LoRA's fp32 input copies):
  ``token_layer_us`` per token and layer for the whole step, fitted to the recorded 32K H100 LoRA
  step (7.13 s); the recorded 128K step (59.5 s, tiled MLP) is then predicted within 10 %
  (``tests/planner/test_timing.py``).
- **attention rate**: ``attn_tflops`` defaults to the ``cudnn`` block kernel's, which the
  ``auto`` backend picks on Hopper (541 TFLOP/s measured at 128K on an H100); the ``torch``
  kernel's fit is :data:`TORCH_ATTN_TFLOPS`.

Validated: the attention compute against the recorded H100 figures (one GPU, emulated ring).
**Unvalidated until a multi-GPU run**: every communication term (bandwidths, latencies, overlap),
the efficiency of ``U > 1`` blocks, and the linear-layer throughput (the default is the recorded LM
head's). Not modelled: DP gradient reduction, ZeRO gathers, norms/RoPE/elementwise kernels, NCCL
kernels slowing concurrent compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringft.ops.sharding import zigzag_length_problem
from ringft.ops.ulysses import heads_problem, kv_replication
from ringft.planner.mixers import linear_exchange_seconds, linear_flops
from ringft.planner.shapes import ModelShape

__all__ = [
    "H100_ATTENTION",
    "H100_STEPS",
    "TORCH_ATTN_TFLOPS",
    "Hardware",
    "LayerTraffic",
    "StepTime",
    "attention_flops",
    "attention_seconds",
    "block_efficiency",
    "layer_traffic",
    "layouts_of",
    "step_time",
]

#: H100 bf16, heads 32 / kv 8 / dim 128, batch 1, backend torch (benchmarks/RESULTS.md, "Ring
#: attention on the GPU"): ``(S, N, ms per rank fwd+bwd)``; ``N = 1`` is one fused causal call, ``N > 1``
#: the emulated ring (sum over ranks / N).
H100_ATTENTION: tuple[tuple[int, int, float], ...] = (
    (16384, 1, 24.7),
    (65536, 1, 383.0),
    (131072, 1, 1536.0),
    *((16384, n, r * 24.7 / n) for n, r in ((2, 1.162), (4, 1.385), (8, 1.899))),
    *((65536, n, r * 383.0 / n) for n, r in ((2, 1.027), (4, 1.071), (8, 1.161))),
    *((131072, n, r * 1536.0 / n) for n, r in ((2, 1.000), (4, 1.023), (8, 1.070))),
)


#: The ``torch`` block kernel's fitted rate (H100_ATTENTION: every point within 2 %).
TORCH_ATTN_TFLOPS = 320.0

#: Recorded H100 ``ringft train`` steps (benchmarks/RESULTS.md, "`ringft train` on
#: one GPU"): Llama-3-8B, one GPU, LoRA r16 on the 7 projections, checkpointing,
#: chunked loss, ``cudnn`` attention: ``(S, tiled MLP tokens or 0, seconds per step)`` from the
#: recorded tokens/s (4598 at 32K, 2204 at 128K).
H100_STEPS: tuple[tuple[int, int, float], ...] = ((32768, 0, 32768 / 4598), (131072, 4096, 131072 / 2204))


@dataclass(frozen=True)
class Hardware:
    """GPU and interconnect parameters; defaults: H100 SXM, 8 GPUs per node, one NIC per GPU.

    Bandwidths in GB/s (1e9 bytes/s) per GPU and direction, latencies in seconds per message.
    """

    attn_tflops: float = 541.0  # the cudnn kernel (auto on Hopper), fwd+bwd at 128K on an H100
    attn_c0: float = 977.0  # key length at which a call spends as long on overhead as on FLOPs
    attn_alpha: float = 1.22
    sms: int = 132  # streaming multiprocessors (H100 SXM)
    matmul_tflops: float = 500.0  # recorded LM head + CE, fwd+bwd: 2.58e13 FLOP in 50 ms (516)
    gpus_per_node: int = 8
    nvlink_gbps: float = 300.0  # assumed: NVLink 4 is 450 GB/s per direction nominal
    ib_gbps: float = 40.0  # assumed: 400 Gb/s NDR per GPU = 50 GB/s nominal, 80 % of it
    nvlink_latency: float = 10e-6  # assumed
    ib_latency: float = 20e-6  # assumed
    token_layer_us: float = 1.78  # memory-bound kernels per token and layer, step total (32K LoRA fit)


@dataclass(frozen=True)
class LayerTraffic:
    """Messages and bytes one rank sends per decoder layer (forward, backward), by kind.

    An all-to-all over ``U`` ranks counts ``U - 1`` messages (one per peer) and the bytes that leave
    the rank; a ring step's point-to-point send is one message.
    """

    a2a_calls: tuple[int, int]
    a2a_messages: tuple[int, int]
    a2a_bytes: tuple[int, int]
    ring_messages: tuple[int, int]
    ring_bytes: tuple[int, int]
    a2a_buffers: tuple[int, ...]  # bytes of each all-to-all buffer (whole, per rank), fwd then bwd
    kv_block_bytes: int  # one ring step's K/V block
    grad_block_bytes: int  # one ring step's dK/dV accumulator


@dataclass
class StepTime:
    """Predicted time of one optimizer micro-step for one layout (seconds; bytes where named)."""

    ulysses: int
    ring: int
    seconds: float
    attention_ideal: float  # attention FLOPs / attn_tflops, whole step
    attention_inefficiency: float  # kernel overhead of small blocks, whole step
    ring_exposed: float  # ring communication not hidden behind compute, whole step
    all_to_all: float  # Ulysses all-to-alls, whole step
    linear: float  # projections, MLP and LM head, whole step
    kv_copies: int
    traffic: LayerTraffic
    elementwise: float = 0.0  # memory-bound kernels (token_layer_us), whole step
    linear_attention: float = 0.0  # Gated DeltaNet kernels and their exchanges, whole step
    links: dict[str, str] = field(default_factory=dict)  # "ring"/"ulysses" -> "NVLink"/"InfiniBand"

    @property
    def overheads(self) -> dict[str, float]:
        """The terms a layout adds to the ideal compute, seconds per step."""
        return {
            "attention kernel inefficiency": self.attention_inefficiency,
            "exposed ring communication": self.ring_exposed,
            "all-to-all communication": self.all_to_all,
        }


def attention_flops(shape: ModelShape, seq_len: int, batch: int = 1) -> tuple[float, float]:
    """Causal attention FLOP of one layer (view) over the whole sequence: ``(forward, backward)``;
    ``B S^2 nh (d + dv)`` forward (``2 B S^2 nh d`` when V's head dim is q/k's), none in a Gated
    DeltaNet layer."""
    if shape.mixer == "linear":
        return 0.0, 0.0
    fwd = 1.0 * batch * seq_len**2 * shape.heads * (shape.head_dim + shape.v_dim)  # QK^T and PV, causal
    return fwd, 2.5 * fwd


def block_efficiency(keys: float, query_tiles: float, hw: Hardware) -> float:
    """Fraction of ``attn_tflops`` a call reaches whose blocks have ``keys`` keys and which has
    ``query_tiles`` tiles of 128 query rows (times heads and batch) to spread over the SMs."""
    return min(1.0, query_tiles / hw.sms) / (1.0 + (hw.attn_c0 / keys) ** hw.attn_alpha)


def attention_seconds(
    shape: ModelShape, seq_len: int, ulysses: int, ring: int, *, hw: Hardware | None = None, batch: int = 1
) -> tuple[float, float]:
    """Attention compute of one layer on one rank, ``(forward, backward)`` seconds, no communication
    (the emulated ring of the H100 measurements)."""
    hw = hw or Hardware()
    u, r = ulysses, ring
    keys = seq_len if r == 1 else seq_len // (2 * r)
    eff = block_efficiency(keys, batch * (shape.heads // u) * (seq_len // r) / 128, hw)
    fwd, bwd = attention_flops(shape, seq_len, batch)
    return fwd / (u * r) / (hw.attn_tflops * 1e12) / eff, bwd / (u * r) / (hw.attn_tflops * 1e12) / eff


def layer_traffic(
    shape: ModelShape, seq_len: int, ulysses: int, ring: int, batch: int = 1, dtype_bytes: int = 2
) -> LayerTraffic:
    """Exactly what :func:`ringft.ops.ulysses.ulysses_ring_attention` sends per rank and layer."""
    u, r, cp = ulysses, ring, ulysses * ring
    kv = shape.kv_heads * kv_replication(shape.kv_heads, u)
    d, dv = shape.head_dim, shape.v_dim
    local = batch * (seq_len // cp) * dtype_bytes  # one value of this rank's tokens
    qkv, out = local * (shape.heads * d + kv * (d + dv)), local * shape.heads * dv
    a2a = (qkv, out, out, qkv) if u > 1 else ()  # fwd: qkv, out; bwd: dout, dqkv
    leaves = lambda b: b * (u - 1) // u  # noqa: E731 - the slices for the other U - 1 ranks
    kv_block = batch * (seq_len // r) * (kv // u) * (d + dv) * dtype_bytes
    grad_block = kv_block * max(4, dtype_bytes) // dtype_bytes  # fp32 (fp64) accumulators
    sends = (r - 1, r - 1) if r > 1 else (0, 0)
    return LayerTraffic(
        a2a_calls=(len(a2a) // 2, len(a2a) // 2),
        a2a_messages=((u - 1) * (len(a2a) // 2),) * 2,
        a2a_bytes=(sum(map(leaves, a2a[:2])), sum(map(leaves, a2a[2:]))),
        ring_messages=(sends[0], sends[1] + (r if r > 1 else 0)),
        ring_bytes=(sends[0] * kv_block, sends[1] * kv_block + (r * grad_block if r > 1 else 0)),
        a2a_buffers=a2a,
        kv_block_bytes=kv_block,
        grad_block_bytes=grad_block,
    )


def _nodes(ranks: list[int], hw: Hardware) -> list[int]:
    return [g // hw.gpus_per_node for g in ranks]


def _ring_link(num_gpus: int, cp: int, u: int, hw: Hardware) -> tuple[float, float, bool]:
    """(GB/s, latency, crosses nodes) of the slowest ring hop over every ring group."""
    r, cross = cp // u, False
    for base in range(0, num_gpus, cp):
        for x in range(u):
            nodes = _nodes([base + p * u + x for p in range(r)], hw)
            cross |= any(nodes[p] != nodes[(p + 1) % r] for p in range(r)) and r > 1
    return (hw.ib_gbps, hw.ib_latency, True) if cross else (hw.nvlink_gbps, hw.nvlink_latency, False)


def _a2a_time(buffer: int, num_gpus: int, cp: int, u: int, hw: Hardware) -> tuple[float, bool]:
    """Seconds of one all-to-all of ``buffer`` bytes per rank (slowest rank), and whether it
    crosses nodes: peers in the node at NVLink, the others through the rank's NIC, concurrently."""
    worst, cross = 0.0, False
    for start in range(0, num_gpus, u):
        nodes = _nodes(list(range(start, start + u)), hw)
        for mine in set(nodes):
            inside = nodes.count(mine)
            t_in = (inside - 1) * buffer / u / (hw.nvlink_gbps * 1e9)
            t_out = (u - inside) * buffer / u / (hw.ib_gbps * 1e9)
            latency = hw.ib_latency if u > inside else hw.nvlink_latency
            worst, cross = max(worst, max(t_in, t_out) + latency), cross or u > inside
    return worst, cross


def _ring_times(c_f: float, c_b: float, traffic: LayerTraffic, r: int, link) -> tuple[float, float]:
    """(forward, backward) seconds of the ring part of one layer on one rank."""
    if r == 1:
        return c_f, c_b
    gbps, latency, _ = link
    t_kv = traffic.kv_block_bytes / (gbps * 1e9) + latency
    t_g = traffic.grad_block_bytes / (gbps * 1e9) + latency
    t_both = (traffic.kv_block_bytes + traffic.grad_block_bytes) / (gbps * 1e9) + latency
    fwd = (r - 1) * max(c_f, t_kv) + c_f
    middle = [t_both] * (r - 2)
    bwd = sum(max(c_b, t) for t in [t_kv, *middle, t_g]) + t_g
    return fwd, bwd


def step_time(
    shape: ModelShape,
    seq_len: int,
    num_gpus: int,
    ulysses: int,
    ring: int,
    *,
    hw: Hardware | None = None,
    batch: int = 1,
    dtype_bytes: int = 2,
    gradient_checkpointing: bool = True,
    lora: bool = False,
    tiled_mlp: bool = False,
    attention_checkpoint: str = "recompute",
) -> StepTime:
    """Predicted seconds of one micro-step (forward + backward) of ``shape`` at ``seq_len`` tokens on
    ``num_gpus`` GPUs, CP groups of ``ulysses x ring`` ranks (``num_gpus`` a multiple of it).

    ``lora``: no weight gradients of the frozen projections and LM head; ``tiled_mlp``: the MLP's
    forward once more; ``attention_checkpoint`` ``save`` / ``offload``: no attention forward in the
    recompute."""
    hw = hw or Hardware()
    u, r, cp = ulysses, ring, ulysses * ring
    problem = heads_problem(shape.heads, u, cp)
    if problem:
        raise ValueError(problem)
    if num_gpus % cp:
        raise ValueError(f"{num_gpus} GPUs do not split into CP groups of {u} x {r} = {cp}")
    problem = zigzag_length_problem(seq_len, cp)
    if problem:
        raise ValueError(problem)
    if shape.linear_layers and u > 1:
        raise ValueError(f"ulysses {u}: the Gated DeltaNet layers of this hybrid run on the plain ring only")
    peak, matmul = hw.attn_tflops * 1e12, hw.matmul_tflops * 1e12
    link = _ring_link(num_gpus, cp, u, hw)
    tokens = batch * seq_len // cp
    passes = 2 if gradient_checkpointing else 1  # forward passes per step
    attn_passes = 1 if attention_checkpoint in ("save", "offload") else passes
    bwd_units = 1 if lora else 2  # input grads (+ weight grads)
    mlp = ("gate_up_proj", "down_proj", "gate_proj", "up_proj")
    sums = dict.fromkeys(("layers", "ideal", "compute", "ring", "a2a", "linear", "gdn"), 0.0)
    traffic, crosses = layer_traffic(shape.layer(0), seq_len, u, r, batch, dtype_bytes), False
    for view, count in shape.layer_views().items():
        lin_f = 2.0 * tokens * view.own_params(active=True) / matmul
        mlp_f = 2.0 * tokens * sum(a * b for n, (a, b) in view.linear_shapes().items() if n in mlp) / matmul
        lin_step = (passes + bwd_units) * lin_f + (mlp_f if tiled_mlp else 0.0)
        sums["linear"] += count * lin_step
        if view.mixer == "linear":  # the chunked delta rule (at the matmul rate) and its exchanges
            f, b = linear_flops(view, tokens)
            x_f, x_b = linear_exchange_seconds(view, batch, r, link[0], link[1], dtype_bytes)
            gdn = (passes * f + b) / matmul + passes * x_f + x_b
            sums["gdn"] += count * gdn
            sums["layers"] += count * (lin_step + gdn)
            continue
        fwd_flops, bwd_flops = (f / cp for f in attention_flops(view, seq_len, batch))
        c_f, c_b = (t / r for t in attention_seconds(view, seq_len, u, r, hw=hw, batch=batch))  # one step
        traffic = layer_traffic(view, seq_len, u, r, batch, dtype_bytes)
        ring_f, ring_b = _ring_times(c_f, c_b, traffic, r, link)
        a2a = [_a2a_time(b, num_gpus, cp, u, hw) for b in traffic.a2a_buffers]
        a2a_f, a2a_b = sum(t for t, _ in a2a[:2]), sum(t for t, _ in a2a[2:])
        crosses |= any(c for _, c in a2a)
        sums["layers"] += count * (lin_step + passes * a2a_f + attn_passes * ring_f + a2a_b + ring_b)
        sums["ideal"] += count * (attn_passes * fwd_flops + bwd_flops) / peak
        sums["compute"] += count * r * (attn_passes * c_f + c_b)
        sums["ring"] += count * (attn_passes * ring_f + ring_b)
        sums["a2a"] += count * (passes * a2a_f + a2a_b)
    head = (4.0 if lora else 6.0) * tokens * shape.vocab * shape.hidden / matmul
    elementwise = shape.layers * tokens * hw.token_layer_us * 1e-6
    return StepTime(
        ulysses=u,
        ring=r,
        seconds=sums["layers"] + head + elementwise,
        attention_ideal=sums["ideal"],
        attention_inefficiency=sums["compute"] - sums["ideal"],
        ring_exposed=sums["ring"] - sums["compute"],
        all_to_all=sums["a2a"],
        linear=sums["linear"] + head,
        elementwise=elementwise,
        linear_attention=sums["gdn"],
        kv_copies=kv_replication(shape.kv_heads, u),
        traffic=traffic,
        links={
            "ring": ("InfiniBand" if link[2] else "NVLink") if r > 1 else "-",
            "ulysses": ("InfiniBand" if crosses else "NVLink") if u > 1 else "-",
        },
    )


def layouts_of(shape: ModelShape, cp: int) -> list[tuple[int, int]]:
    """Every ``(ulysses, ring)`` with ``ulysses * ring == cp`` whose Ulysses size splits the heads
    (the ring alone for a model with Gated DeltaNet layers)."""
    sizes = [1] if shape.linear_layers else range(1, cp + 1)
    return [(u, cp // u) for u in sizes if cp % u == 0 and not heads_problem(shape.heads, u)]
