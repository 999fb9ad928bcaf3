"""Every planner figure quoted in recipes/README.md, README.md's results and the recipes' comments
(memory, and the step-time model's tokens/s and step times: planned, not measured) is what ``ringft
plan`` (``--time``) prints for its command, rounded as quoted; each quoted ``python -m ringft plan``
command is the one the figure comes from."""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ringft.planner import plan_main

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30

LLAMA = "--model llama-3-8b"
MISTRAL = "--config-json recipes/mistral_7b_512k/mistral-7b-v0.1.config.json"
# SmolLM2-135M-Instruct as the smollm2_32k headers describe it (the recipes name the converted
# folder models/smollm2-135m-instruct, absent here); written to a temporary config.json.
SMOLLM2 = "--config-json {smollm2}"
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
NODE = "--seq-len 524288 --gpus 8 --gpu-mem 80 --cp-size 8"
Z3 = f"{NODE} --zero 3"
OFFLOAD = "--offload-optimizer --offload-params"
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
LORA = f"{NODE} --lora --lora-rank 16 --lora-targets {ALL_LINEAR}"
LORA_ATTN = f"{NODE} --lora --lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj"
TWO_NODES = "--seq-len 524288 --gpus 16 --gpu-mem 79.6"
LORA_16 = f"{TWO_NODES} --lora --lora-rank 16 --lora-targets {ALL_LINEAR}"
Z3_64K_16 = "--seq-len 65536 --gpus 16 --gpu-mem 79.6 --zero 3"
STAGES = ((1, "64k", 65536, 1), (2, "128k", 131072, 2), (3, "256k", 262144, 4), (4, "512k", 524288, 8))
SMOL_STAGES = (("1_16k", "16K", 16384), ("2_32k", "32K", 32768))


def gib(key: str, digits: int = 1, ranks: int = 1) -> Callable[[dict], str]:
    """A plan's term ``key`` (or the sum of ``+``-joined terms; ``ring``: the ring buffers) in GiB."""

    def value(plan: dict) -> str:
        terms = [plan["details"]["layer_ws.ring_buffers"] if k == "ring" else plan[k] for k in key.split("+")]
        return f"{ranks * sum(terms) / GIB:.{digits}f}"

    return value


TOTAL, TOTAL0, HOST, HOST0 = gib("total"), gib("total", 0), gib("cpu_offloaded"), gib("cpu_offloaded", 0)
LONGEST = "longest"  # the longest sequence that fits the layout, in tokens with thousands commas


@dataclass(frozen=True)
class Timed:
    """A figure of the step-time model: ``pick`` of the text ``ringft plan ... --time`` prints."""

    pick: Callable[[str], str]


_ROW = r"(?m)^\s+{} x {}" + r"\s+(\S+ m?s)\s+(\d+)" + r"\s+(\S+ m?s)" * 5
_COLUMNS = ("step", "tokens", "ideal", "kernel", "ring", "a2a", "linear")


def timed(u: int, r: int, column: str = "tokens") -> Timed:
    """Layout ``u x r``'s ``column`` of the step-time table (tokens/s per GPU; the others with unit)."""
    return Timed(lambda out: re.search(_ROW.format(u, r), out).group(1 + _COLUMNS.index(column)))


def slower(u: int, r: int) -> Timed:
    """How much longer layout ``u x r``'s step is than the recommended one's, as printed ("5.8%")."""
    pattern = rf"vs ulysses {u} x ring {r} \(\w+\): \S+ \S+ \(\+([\d.]+%)\)"
    return Timed(lambda out: re.search(pattern, out)[1])


SPREAD = Timed(lambda out: re.search(r"all splits are within ([\d.]+%)", out)[1])
A2A = Timed(lambda out: re.search(r"([\d.]+ [MG]iB) leaving each rank per layer", out)[1])

Quantity = Callable[[dict], str] | str | Timed

# (file, its text with {} per figure, one (ringft plan arguments, quantity) per {}). The files'
# comments are compared with "#" and line breaks removed.
FIGURES: list[tuple[str, str, list[tuple[str, Quantity]]]] = [
    ("recipes/README.md", "| ~{} every stage |", [(f"{LLAMA} {Z3}", TOTAL)]),
    ("recipes/README.md", "| ~{} (measured analogue", [(f"{LLAMA} {LORA}", TOTAL)]),
    ("recipes/README.md", "| ~{} every stage | `mistral_7b_512k/run.sh`", [(f"{MISTRAL} {Z3}", TOTAL)]),
    *[
        ("recipes/README.md", text, [(f"{SMOLLM2} {a}", TOTAL) for a in smol])
        for text in ("| {} / {} | `smollm2_32k/run.sh`", "Planner: {} / {} GiB per GPU")
        for smol in [
            [f"--seq-len {s} --gpus 1 --gpu-mem 80 --no-gradient-checkpointing" for *_, s in SMOL_STAGES]
        ]
    ],
    # "Two nodes: Ulysses x ring": the step-time model's tokens/s per GPU (planned by `--time`, one
    # CP size per command), the memory column and the text below it.
    *[
        (
            "recipes/README.md",
            text,
            [(f"{LLAMA} {LORA_16} --cp-size {cp} --time", timed(u, r)), (f"{LLAMA} {LORA_16} {mem}", TOTAL)],
        )
        for text, cp, u, r, mem in (
            ("| 1 x 8 | {} | {} GiB |", 8, 1, 8, "--cp-size 8"),
            ("| 8 x 1 | {} | {} GiB |", 8, 8, 1, "--cp-size 8 --ulysses-size 8"),
            ("| 1 x 16 | {} | {} GiB |", 16, 1, 16, "--cp-size 16"),
            ("| **{}** | **{} GiB** |", 16, 8, 2, "--cp-size 16 --ulysses-size 8"),
        )
    ],
    (
        "recipes/README.md",
        "| {} / {} | {} / {} GiB |",
        [
            (f"{LLAMA} {TWO_NODES} --zero 3 --cp-size 8 --time", timed(1, 8)),
            (f"{LLAMA} {TWO_NODES} --zero 3 --cp-size 16 --time", timed(8, 2)),
            (f"{LLAMA} {TWO_NODES} --zero 3 --cp-size 8", TOTAL),
            (f"{LLAMA} {TWO_NODES} --zero 3 --cp-size 16 --ulysses-size 8", TOTAL),
        ],
    ),
    (
        "recipes/README.md",
        "| **{}** | {} GiB |",
        [
            (f"{LLAMA} {Z3_64K_16} --cp-size 1 --time", timed(1, 1)),
            (f"{LLAMA} {Z3_64K_16} --cp-size 1", TOTAL),
        ],
    ),
    # one memory figure for every split of a row: the Ulysses size does not change this plan's memory
    *[
        (
            "recipes/README.md",
            f"| {' / '.join('{}' for _ in splits)} | {{}} GiB |",
            [
                *((f"{LLAMA} {Z3_64K_16} --cp-size {cp} --time", timed(u, cp // u)) for u in splits),
                (f"{LLAMA} {Z3_64K_16} --cp-size {cp} --ulysses-size {u}", TOTAL),
            ],
        )
        for cp, splits in ((8, (1, 8)), (16, (1, 8, 16)))
        for u in splits
    ],
    *[
        ("recipes/README.md", text, [(f"{LLAMA} {a} --time", q) for a, q in figs])
        for text, figs in [
            (
                "(ideal attention is {} of the {} of a cp 16 LoRA step), so every split of cp 8 is within {} "
                "and every split of cp 16 within {}",
                [
                    (f"{LORA_16} --cp-size 16", timed(8, 2, "ideal")),
                    (f"{LORA_16} --cp-size 16", timed(8, 2, "step")),
                    (f"{LORA_16} --cp-size 8", SPREAD),
                    (f"{LORA_16} --cp-size 16", SPREAD),
                ],
            ),
            (
                "(attention kernel overhead: {} vs {} per step)",
                [(f"{LORA_16} --cp-size 16", timed(u, r, "kernel")) for u, r in ((1, 16), (8, 2))],
            ),
            (
                "(the 8-rank ring's step is {} longer than 8 x 1's)",
                [(f"{Z3_64K_16} --cp-size 8", slower(1, 8))],
            ),
            (
                "the hybrid 8 x 2 beats the 16-rank ring by {} (the ring's steps over 2K keys are too short "
                "to hide its InfiniBand hops: {} exposed, and their kernels lose {} to overhead)",
                [
                    (f"{Z3_64K_16} --cp-size 16", slower(1, 16)),
                    (f"{Z3_64K_16} --cp-size 16", timed(1, 16, "ring")),
                    (f"{Z3_64K_16} --cp-size 16", timed(1, 16, "kernel")),
                ],
            ),
            ("(its all-to-alls move {} per rank and layer at 512K)", [(f"{LORA_16} --cp-size 8", A2A)]),
        ]
    ],
    (
        "recipes/README.md",
        "{} instead of {} GiB per GPU for the LoRA stage (longest sequence that fits: {} instead of {} "
        "tokens)",
        [
            (f"{LLAMA} {LORA_16} --cp-size 16 --ulysses-size 8", TOTAL),
            (f"{LLAMA} {LORA_16} --cp-size 8", TOTAL),
            (f"{LLAMA} {LORA_16} --cp-size 16 --ulysses-size 8", LONGEST),
            (f"{LLAMA} {LORA_16} --cp-size 8", LONGEST),
        ],
    ),
    (
        "README.md",
        "| 8 x 2 hybrid {} vs ring {} per step |",
        [(f"{LLAMA} {Z3_64K_16} --cp-size 16 --time", timed(u, r, "step")) for u, r in ((8, 2), (1, 16))],
    ),
    ("recipes/README.md", "fits ({} GiB with ZeRO-3)", [(f"{LLAMA} {Z3_64K_16} --cp-size 1", TOTAL)]),
    # "Memory (planner estimates)": Llama-3-8B and Mistral-7B-v0.1 columns.
    *[
        (
            "recipes/README.md",
            f"| {row} | {cells} | {cells} |",
            [(f"{m} {a}", q) for m in (LLAMA, MISTRAL) for a, q in figs],
        )
        for row, cells, figs in [
            ("ZeRO-3 (every stage: 64K/cp1, 128K/cp2, 256K/cp4, 512K/cp8)", "{}", [(Z3, TOTAL)]),
            ("+ `train.offload_activations`", "{}", [(f"{Z3} --offload-activations", TOTAL)]),
            (
                "ZeRO-3 + optimizer & param offload (`deepspeed_zero3_offload.yaml`)",
                "{} (+{} host)",
                [(f"{Z3} {OFFLOAD}", TOTAL), (f"{Z3} {OFFLOAD}", HOST)],
            ),
            ("ZeRO-2 (weights replicated)", "{}", [(f"{NODE} --zero 2", TOTAL)]),
            (
                "512K on 16 GPUs (2 nodes, dp 2 x cp 8), ZeRO-3",
                "{}",
                [("--seq-len 524288 --gpus 16 --gpu-mem 80 --cp-size 8 --zero 3", TOTAL)],
            ),
            (
                "512K on 16 GPUs, ZeRO-3, `--parallel.cp_size 16 --parallel.ulysses_size 8`",
                "{}",
                [("--seq-len 524288 --gpus 16 --gpu-mem 80 --zero 3 --cp-size 16 --ulysses-size 8", TOTAL)],
            ),
            ("LoRA r16, all linear, no ZeRO (DDP)", "{}", [(LORA, TOTAL)]),
            ("LoRA r16, attention projections only", "{}", [(LORA_ATTN, TOTAL)]),
            (
                "longest sequence at cp 8, ZeRO-3 / + offload",
                "{} / {}",
                [(Z3, LONGEST), (f"{Z3} {OFFLOAD}", LONGEST)],
            ),
        ]
    ],
    (
        "recipes/README.md",
        "| ZeRO-3, unchunked loss | {} (does not fit) | {} |",
        [(f"{LLAMA} {Z3} --no-chunked-loss", TOTAL), (f"{MISTRAL} {Z3} --no-chunked-loss", TOTAL)],
    ),
    ("recipes/README.md", "The planner's {} GiB sits between", [(f"{LLAMA} {LORA}", TOTAL)]),
    # The 512K recipes' headers (each names its command) and comments.
    *[
        (f"recipes/{folder}/stage{i}_{k}.yaml", text, [(f"{model} {a}", q) for a, q in figs])
        for folder, model in (("llama3_8b_512k", LLAMA), ("mistral_7b_512k", MISTRAL))
        for i, k, s, cp in STAGES
        for stage in [f"--seq-len {s} --gpus 8 --gpu-mem 80 --zero 3 --cp-size {cp}"]
        for text, figs in [
            (
                f"~{{}} GiB/rank with ZeRO-3, no offload, per-layer checkpointing, chunked loss: "
                f"python -m ringft plan {model} {stage}",
                [(stage, TOTAL)],
            ),
            ("With train.offload_activations: ~{} GiB/rank", [(f"{stage} --offload-activations", TOTAL)]),
            (
                "deepspeed_zero3_offload.yaml: ~{} GiB/rank (+~{} GiB/rank of host memory)",
                [(f"{stage} {OFFLOAD}", TOTAL), (f"{stage} {OFFLOAD}", HOST)],
            ),
            ("pinned host memory (~{} GiB/rank)", [(f"{stage} --offload-activations", TOTAL)]),
            # 64K tokens per rank in every stage: one plan (512K, cp 8) for all four stages' comment
            (
                "(planner: ~{} GiB/rank in all unchunked)"
                if model == LLAMA
                else "(planner ~{} GiB/rank at 64K",
                [(f"{Z3} --no-chunked-loss", TOTAL0)],
            ),
        ]
    ],
    *[
        ("recipes/llama3_8b_512k/stage4_512k_lora.yaml", text, [(f"{LLAMA} {a}", q) for a, q in figs])
        for text, figs in [
            ("the optimizer state is tiny ({} GiB/rank)", [(LORA, gib("grads+optimizer"))]),
            (
                "{} instead of {} GiB/rank by the planner",
                [(f"{LORA_16} --cp-size 16 --ulysses-size 8", TOTAL), (f"{LORA_16} --cp-size 8", TOTAL)],
            ),
            (
                "~{} GiB/rank (frozen base {} GiB, adapters + grads + Adam {} GiB, checkpointed activations "
                "{} GiB, one-layer recompute {} GiB): python -m ringft plan --model llama-3-8b --seq-len "
                f"524288 --gpus 8 --gpu-mem 80 --cp-size 8 --lora --lora-rank 16 --lora-targets {ALL_LINEAR}",
                [
                    (LORA, q)
                    for q in (
                        TOTAL,
                        gib("weights"),
                        gib("grads+optimizer"),
                        gib("checkpointed_activations"),
                        gib("layer_working_set"),
                    )
                ],
            ),
            ("(attention projections only: ~{} GiB/rank.)", [(LORA_ATTN, TOTAL)]),
            (
                "(planned by the step-time model, not measured: {} vs {} per GPU;",
                [
                    (f"{LORA_16} --cp-size 16 --time", timed(8, 2)),
                    (f"{LORA_16} --cp-size 8 --time", timed(1, 8)),
                ],
            ),
            ("no ring buffers - ~{} GiB by the planner", [(LORA, gib("ring"))]),
            ("The planner's {} includes 3 GiB of overhead", [(LORA, TOTAL)]),
            ("fits without (~{} GiB)", [(LORA, TOTAL0)]),
            ("(planner: ~{} GiB/rank in all unchunked)", [(f"{LORA} --no-chunked-loss", TOTAL0)]),
        ]
    ],
    *[
        (f"recipes/smollm2_32k/stage{name}.yaml", text, [(f"{SMOLLM2} {smol}", q)])
        for name, short, s in SMOL_STAGES
        for smol in [f"--seq-len {s} --gpus 1 --gpu-mem 80 --no-gradient-checkpointing"]
        for text, q in [
            (
                "~{} GiB/rank without activation checkpointing: python -m ringft plan --model "
                f"models/smollm2-135m-instruct --seq-len {s} --gpus 1 --gpu-mem 80 "
                "--no-gradient-checkpointing",
                TOTAL0,
            ),
            (f"activations of {short} tokens (~{{}} GiB)", gib("checkpointed_activations", 0)),
        ]
    ],
    (
        "recipes/smollm2_32k/README.md",
        "~{} GiB per GPU without activation checkpointing",
        [(f"{SMOLLM2} --seq-len 32768 --gpus 1 --gpu-mem 80 --no-gradient-checkpointing", TOTAL0)],
    ),
    *[  # recipes/trl_sft: 64K-token rows on a ring of 8 under FSDP2 (ZeRO-3 for the planner)
        (
            path,
            text,
            [(f"{LLAMA} --seq-len 65536 --gpus 8 --gpu-mem 80 --cp 8 --zero 3", q) for q in (TOTAL, LONGEST)],
        )
        for path, text in [
            ("recipes/trl_sft/run.sh", "ZeRO-3 for the planner): {} GiB of 80, and rows of up to {} tokens"),
            ("recipes/trl_sft/README.md", "ZeRO-3 for the planner): {} GiB per GPU; rows of up to {} tokens"),
        ]
    ],
    ("recipes/accelerate/deepspeed_zero3.yaml", "64K tokens/rank: ~{} GiB/rank", [(f"{LLAMA} {Z3}", TOTAL0)]),
    ("recipes/accelerate/fsdp.yaml", "~{} GiB/rank for Llama-3-8B", [(f"{LLAMA} {Z3}", TOTAL0)]),
    (
        "recipes/accelerate/deepspeed_zero3_offload.yaml",
        "~{} GiB/rank on the GPU (vs ~{} GiB without offload) and ~{} GiB/rank of host memory (~{} GiB for 8 "
        "ranks, pinned: the node needs well over that free); longest sequence at cp 8 on 80 GiB rises "
        "from {} to {} tokens",
        [
            (f"{LLAMA} {Z3} {OFFLOAD}", TOTAL0),
            (f"{LLAMA} {Z3}", TOTAL0),
            (f"{LLAMA} {Z3} {OFFLOAD}", HOST0),
            (f"{LLAMA} {Z3} {OFFLOAD}", gib("cpu_offloaded", 0, ranks=8)),
            (f"{LLAMA} {Z3}", LONGEST),
            (f"{LLAMA} {Z3} {OFFLOAD}", LONGEST),
        ],
    ),
]


def _normalized(path: str) -> str:
    """The file's text without comment markers, line breaks and line continuations, whitespace
    collapsed."""
    lines = (REPO / path).read_text().splitlines()
    return " ".join(" ".join(line.strip().lstrip("#").removesuffix("\\") for line in lines).split())


_LONGEST = re.compile(r"longest sequence that fits this layout .*: (\d+)")


@cache
def _output(args: str, as_json: bool) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(args.split() + (["--json"] if as_json else []))
    return out.getvalue()


def _figure(args: str, quantity: Quantity) -> str:
    if isinstance(quantity, Timed):
        return quantity.pick(_output(args, False))
    if quantity == LONGEST:
        return f"{int(_LONGEST.search(_output(args, False)).group(1)):,}"
    plans = json.loads(_output(args, True))["plans"]
    assert len(plans) == 1, f"ringft plan {args}: one layout expected (give --cp-size)"
    return quantity(plans[0])


def test_quoted_planner_figures_are_what_the_planner_prints(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMOLLM2_CONFIG))
    wrong = []
    for path, text, figures in FIGURES:
        quoted = text.format(*(_figure(a.format(smollm2=config), q) for a, q in figures))
        if quoted not in _normalized(path):
            wrong.append(f"{path}: should say {quoted!r}")
    assert not wrong, "planner figures drifted:\n" + "\n".join(wrong)
