"""ringft.train end to end on gloo CPU processes: DP x CP equivalence, gradient accumulation,
kill-and-resume (also mid-save), recipe validation, the CLI's error path, LoRA export.

Every training is a tiny fp32 LLaMA built from config (hidden 32, 1 layer, the shipped "demo"
tokenizer) on a saved random-token dataset with seq_len 64 (the synthetic line-retrieval data
needs at least ~128 tokens). Examples have ragged lengths and masked prefixes, so replicas hold
different numbers of valid targets: a wrong loss normalisation across DP / CP / micro-steps changes
the step loss by >= 1 / (valid targets of a step, ~125) = 8e-3 relative, and a wrong data order or
a skipped optimizer step changes the weights' update by whole per cents.

Tolerances (derived, not fitted; issue 18). The runs compared compute the same math with the fp32
sums in another order (ring vs full attention, sharded vs whole batch, chunked vs full logits).
Recursive summation of n terms is off by at most (n - 1) * eps relative, so:
- a step's loss, a mean over the step's TOKENS_PER_STEP tokens of a log-sum-exp over VOCAB logits:
  LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * eps = 2.3e-4 (35x below the 8e-3 of a wrong denominator);
- the weights after STEPS AdamW steps, compared as updates (final - initial, per tensor, relative to
  the norm of the reference update): AdamW's update is scale-free, so the gradients' relative
  error (the same reductions) passes into it 1:1 and adds up over the steps:
  UPDATE_RTOL = STEPS * LOSS_RTOL = 9e-4 (a skipped step changes the update by ~25 %).
Resuming from a checkpoint replays the same operations in the same order: bit-exact.

Trainings are expensive to launch (each process imports torch + transformers: seconds on CPU), so
runs that belong together share one ``run_distributed`` call: ``Accelerator.end_training()``
destroys the default process group, so between runs the worker resets accelerate's shared state and
opens a fresh gloo group (a FileStore in the test's tmp dir). A run that must start from a crash
(``--resume`` after a SIGKILL) always starts in fresh processes. Crashes are injected by the test
worker (``_inject_kill``), not by the library.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringft.ops.parallel import ParallelLayout
from ringft.ops.spawn import run_distributed
from ringft.train.recipe import RecipeError, recipe_from_dict, validate

REPO = Path(__file__).resolve().parents[2]
EPS32 = torch.finfo(torch.float32).eps
VOCAB = 1658  # len() of the shipped demo tokenizer: the log-sum-exp's reduction length
TOKENS_PER_STEP = 4 * 64  # tiny_recipe: a global batch of 4 sequences of data.seq_len 64
STEPS = 4  # tiny_recipe's train.max_steps
LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * EPS32  # worst-case reordered fp32 sums of one step's loss
UPDATE_RTOL = STEPS * LOSS_RTOL  # the gradients' relative error, passed 1:1 by AdamW, over STEPS steps
RUN_TIMEOUT = 240.0  # run_distributed's own timeout (a hang fails instead of blocking the suite)


# ---------------------------------------------------------------------------------------------
# Recipes and data
# ---------------------------------------------------------------------------------------------


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_recipe(output_dir, data_path, **sections) -> dict:
    """A raw recipe mapping (what a YAML file parses to); ``sections`` override per section."""
    raw = {
        "model": {
            "config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 128,
            },
            "model_type": "llama",
            "tokenizer": "demo",
            "dtype": "fp32",
            "attn_backend": "torch",
        },
        "data": {"path": str(data_path), "seq_len": 64},
        "parallel": {"cp_size": 1},
        "train": {
            "micro_batch_size": 2,
            "grad_accum": 1,
            "max_steps": 4,
            "lr": 1e-3,
            "warmup_steps": 1,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "grad_clip": 1.0,
            "gradient_checkpointing": False,
            "chunked_loss": False,
            "loss_chunk_size": 16,
            "seed": 0,
        },
        "checkpoint": {"output_dir": str(output_dir), "save_every": 0, "keep": 2},
        "logging": {"tracker": "none"},
    }
    return _merge(raw, sections)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> str:
    """48 random-token examples of 20..64 tokens; labels mask a random prefix (a "prompt")."""
    import datasets

    gen = torch.Generator().manual_seed(1234)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for _ in range(48):
        n = int(torch.randint(20, 65, (1,), generator=gen))
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()  # 0..2 are the demo specials
        labels = list(ids)
        k = int(torch.randint(0, n // 2, (1,), generator=gen))
        labels[:k] = [-100] * k
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
    path = tmp_path_factory.mktemp("data") / "random_tokens"
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return str(path)


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((Path(output_dir) / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {output_dir}/final"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def initial_weights(raw: dict) -> dict[str, torch.Tensor]:
    """The weights a run of ``raw`` (a model built from config, seeded) starts from."""
    from ringft.train.build import build_model

    return build_model(recipe_from_dict(raw), vocab_size=VOCAB).state_dict()


def update_errors(final: dict, reference: dict, initial: dict) -> dict[str, float]:
    """Per tensor: ||(final - initial) - (reference - initial)|| / ||reference - initial||.

    A tensor the reference did not move must not move (error 0 or inf)."""
    assert sorted(final) == sorted(reference), (sorted(final), sorted(reference))
    errors = {}
    for name, ref in reference.items():
        start = initial[name].to(ref.dtype)
        moved = (ref - start).double().norm().item()
        diff = (final[name] - ref).double().norm().item()
        errors[name] = diff / moved if moved else (0.0 if diff == 0 else float("inf"))
    return errors


def assert_updates_close(final: dict, reference: dict, initial: dict, rtol: float) -> None:
    """The runs' updates agree within ``rtol`` (relative, per tensor), and the reference trained."""
    total = sum(
        (reference[k] - initial[k].to(reference[k].dtype)).double().norm().item() ** 2 for k in reference
    )
    assert total > 0, "the reference run did not change any weight"
    errors = update_errors(final, reference, initial)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, (
        f"update of {worst} differs by {errors[worst]:.3e} of its norm (rtol {rtol:.1e})"
    )


def assert_weights_equal(a: dict, b: dict) -> None:
    """Bit-exact (for runs that replay the same operations, e.g. a resume)."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


# ---------------------------------------------------------------------------------------------
# Workers (module level: run_distributed spawns and imports this module)
# ---------------------------------------------------------------------------------------------


def _one_thread() -> None:
    """Keep run_distributed's one thread per rank. With OMP_NUM_THREADS unset, accelerate's MULTI_CPU
    setup calls ``torch.set_num_threads(physical cores / LOCAL_WORLD_SIZE)``, and run_distributed
    does not set LOCAL_WORLD_SIZE (read as 1): every rank would take all cores (2.5x slower here)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _fresh_group(store_dir: str, index: int, rank: int, world: int) -> None:
    """Prepare this process for another Trainer after ``end_training`` destroyed the group."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    if not dist.is_initialized():
        Path(store_dir).mkdir(parents=True, exist_ok=True)  # (a FileStore in a missing folder hangs)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_dir}/pg-{index}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=RUN_TIMEOUT),
        )


def _inject_kill(trainer, spec: str, rank: int) -> None:
    """SIGKILL this process at a point of the run: ``step:N:R`` (rank R, right after optimizer step N)
    or ``save:N:R`` (rank R, inside the save of step N: after every rank wrote accelerate's state,
    before trainer_state.json and the rename)."""
    import signal

    point, at_step, at_rank = spec.split(":")
    if int(at_rank) != rank:
        return

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "step":
        train_step = trainer.train_step

        def train_step_then_die(step: int):
            out = train_step(step)
            if step + 1 == int(at_step):
                die()
            return out

        trainer.train_step = train_step_then_die
    elif point == "save":
        accelerator = trainer.accelerator
        save_state = accelerator.save_state

        def save_state_then_die(path: str, *args, **kwargs):
            out = save_state(path, *args, **kwargs)
            if Path(path).name == f"step-{int(at_step):08d}.tmp":
                accelerator.wait_for_everyone()
                die()
            return out

        accelerator.save_state = save_state_then_die
    else:
        raise ValueError(f"unknown kill point {spec!r}")


def _train_runs(rank: int, world: int, runs: list[dict], store_dir: str) -> list[dict]:
    """Train each of ``runs`` in turn: ``{"recipe": raw, "resume": bool, "kill": spec|None,
    "record": path|None, "initial_adapter": path|None}``. Returns per run the losses and the step it
    started from.

    ``record`` (rank 0) writes the result as JSON as soon as the run ends: a later run of the same
    call may be one that is meant to die, and then nothing is returned.
    """
    from ringft.train.loop import Trainer

    _one_thread()
    results = []
    for i, run in enumerate(runs):
        if i:
            _fresh_group(store_dir, i, rank, world)
        recipe = recipe_from_dict(run["recipe"])
        trainer = Trainer(recipe, resume=run.get("resume", False), progress=False)
        if run.get("kill"):
            _inject_kill(trainer, run["kill"], rank)
        if run.get("initial_adapter") and rank == 0:  # the LoRA weights a run starts from
            from peft import get_peft_model_state_dict
            from safetensors.torch import save_file

            start_state = get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.wrapped).model)
            save_file(
                {k: v.detach().clone().contiguous() for k, v in start_state.items()}, run["initial_adapter"]
            )
        start = trainer.start_step
        res = trainer.run()
        out = {"losses": res.losses, "start_step": start, "steps": res.steps}
        if run.get("record") and rank == 0:
            Path(run["record"]).write_text(json.dumps(out))
        results.append(out)
    return results


def _lora_worker(rank: int, world: int, raw: dict) -> dict:
    from peft import PeftModel

    from ringft.train.build import build_model
    from ringft.train.loop import Trainer

    _one_thread()
    recipe = recipe_from_dict(raw)
    trainer = Trainer(recipe, progress=False)
    res = trainer.run()
    out: dict = {"losses": res.losses}
    if rank != 0:
        return out
    trained = trainer.accelerator.unwrap_model(trainer.wrapped).model
    lora_trained = {k: v.detach().clone() for k, v in trained.named_parameters() if "lora_" in k}
    out["trainable"] = sorted(k for k, v in trained.named_parameters() if v.requires_grad)
    # The frozen base weights did not move: compare with a freshly built (same seed) base model.
    base = build_model(recipe, vocab_size=len(trainer.tokenizer))
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    trained_base = {
        k.replace(".base_layer", ""): v
        for k, v in trained.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    out["base_unchanged"] = sorted(trained_base) == sorted(base_state) and all(
        torch.equal(base_state[k], trained_base[k]) for k in base_state
    )
    # Load the exported adapter onto that base model (plain sdpa attention, no ring).
    loaded = PeftModel.from_pretrained(base, str(Path(res.final_dir)))
    lora_loaded = {k: v for k, v in loaded.named_parameters() if "lora_" in k}
    out["lora_keys_match"] = sorted(lora_trained) == sorted(lora_loaded)
    out["lora_max_diff"] = max((lora_trained[k] - lora_loaded[k]).abs().max().item() for k in lora_trained)
    out["lora_b_norm"] = sum(v.norm().item() for k, v in lora_loaded.items() if "lora_B" in k)
    ids = torch.randint(3, 200, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with loaded.disable_adapter():
            plain = loaded(input_ids=ids).logits
        adapted = loaded(input_ids=ids).logits
        out["adapter_effect"] = (adapted - plain).abs().max().item()
        out["logits_scale"] = adapted.abs().max().item()
        merged = loaded.merge_and_unload()
        out["merged_vs_adapted"] = (merged(input_ids=ids).logits - adapted).abs().max().item()
    return out


# ---------------------------------------------------------------------------------------------
# Data order
# ---------------------------------------------------------------------------------------------


def _layout(dp: int, cp: int, dp_rank: int, cp_rank: int = 0) -> ParallelLayout:
    return ParallelLayout(dp * cp, dp_rank * cp + cp_rank, cp, dp, cp_rank, dp_rank)


@pytest.mark.parametrize("dp,ga,shuffle", [(2, 1, True), (2, 2, True), (4, 3, False), (3, 2, True)])
def test_example_indices_global_batch_matches_one_process(dp, ga, shuffle):
    """Per optimizer step, the DP replicas (x grad-accum micro-steps) read exactly the examples one
    process reads with ``micro_batch = dp * mb`` (and ``grad_accum = 1``), epochs included; all CP
    ranks of a replica read the same examples."""
    from ringft.train.data import example_indices

    mb, n = 2, 13  # n is no multiple of the global batch: steps straddle epoch boundaries

    def recipe(micro_batch, grad_accum):
        return recipe_from_dict(
            tiny_recipe(
                "out",
                None,
                data={"path": None, "synthetic": {}, "shuffle": shuffle},
                train={"micro_batch_size": micro_batch, "grad_accum": grad_accum},
            )
        )

    many, one = recipe(mb, ga), recipe(dp * mb * ga, 1)
    for step in range(7):
        reference = example_indices(step, 0, _layout(1, 1, 0), one, n)
        assert len(reference) == dp * mb * ga
        got = []
        for micro in range(ga):
            for d in range(dp):
                idx = example_indices(step, micro, _layout(dp, 2, d, 0), many, n)
                assert idx == example_indices(step, micro, _layout(dp, 2, d, 1), many, n)
                got.extend(idx)
        assert sorted(got) == sorted(reference), f"step {step}: {got} vs {reference}"
    # The stream is a permutation per epoch: the first n positions visit every example once.
    seen = [i for s in range(n) for i in example_indices(s, 0, _layout(1, 1, 0), one, n)]
    assert sorted(seen[:n]) == list(range(n))


# ---------------------------------------------------------------------------------------------
# Equivalences
# ---------------------------------------------------------------------------------------------


DOCS_PER_ROW = 3  # packed_data_path: documents per packed row (a step of 4 rows holds 12)
# The one-process reference of the packed run sums a step's loss over 12 rows of 64 tokens.
DOC_LOSS_RTOL = (DOCS_PER_ROW * TOKENS_PER_STEP + VOCAB) * EPS32
DOC_UPDATE_RTOL = STEPS * DOC_LOSS_RTOL


@pytest.fixture(scope="module")
def packed_data_path(tmp_path_factory) -> tuple[str, str]:
    """The same documents twice: 16 rows of 3 documents packed into data.seq_len 64 with their
    offsets (``cu_seqlens``, as data_prep/pack.py --document-masking writes them), and the 48
    documents one per row. Lengths 5..21 put boundaries inside, across and on cp=2's chunk edges
    (16 tokens); labels mask a random prompt prefix of each document."""
    import datasets

    gen = torch.Generator().manual_seed(4321)
    packed: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "cu_seqlens": []}
    separate: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for _ in range(16):
        row = {"input_ids": [], "labels": [], "cu_seqlens": [0]}
        for _ in range(DOCS_PER_ROW):
            n = int(torch.randint(5, 22, (1,), generator=gen))
            ids = torch.randint(3, 200, (n,), generator=gen).tolist()
            labels = list(ids)
            k = int(torch.randint(0, n // 2, (1,), generator=gen))
            labels[:k] = [-100] * k
            row["input_ids"] += ids
            row["labels"] += labels
            row["cu_seqlens"].append(row["cu_seqlens"][-1] + n)
            separate["input_ids"].append(ids)
            separate["labels"].append(labels)
        for key, value in row.items():
            packed[key].append(value)
    root = tmp_path_factory.mktemp("data")
    datasets.Dataset.from_dict(packed).save_to_disk(str(root / "packed"))
    datasets.Dataset.from_dict(separate).save_to_disk(str(root / "separate"))
    return str(root / "packed"), str(root / "separate")


@pytest.mark.numerics
@pytest.mark.timeout(420)
def test_dp_cp_matches_one_process(tmp_path, data_path, packed_data_path):
    """(dp=2, cp=2) on 4 processes, chunked loss == (dp=1, cp=1) with twice the micro batch on 1
    process, full-logits loss: same per-step losses and weight updates.

    Document masking: (dp=2, cp=2) on packed rows with ``data.document_masking`` == one process
    training on the same documents one per row (12 rows = the documents of a step's 4 packed rows;
    no shuffling, so both read the documents in the same steps)."""
    ring = tiny_recipe(tmp_path / "dp2cp2", data_path, parallel={"cp_size": 2}, train={"chunked_loss": True})
    single = tiny_recipe(tmp_path / "one", data_path, train={"micro_batch_size": 4})
    packed, separate = packed_data_path
    docs_ring = tiny_recipe(
        tmp_path / "docs-dp2cp2",
        packed,
        data={"shuffle": False, "document_masking": True},
        parallel={"cp_size": 2},
        train={"chunked_loss": True},
    )
    docs_single = tiny_recipe(
        tmp_path / "docs-one",
        separate,
        data={"shuffle": False},
        train={"micro_batch_size": DOCS_PER_ROW * 4},
    )
    runs = [{"recipe": ring}, {"recipe": docs_ring}]
    got = run_distributed(_train_runs, 4, runs, str(tmp_path / "four"), timeout=RUN_TIMEOUT)
    runs = [{"recipe": single}, {"recipe": docs_single}]
    ref = run_distributed(_train_runs, 1, runs, str(tmp_path / "one-proc"), timeout=RUN_TIMEOUT)
    for i, rtol in ((0, LOSS_RTOL), (1, DOC_LOSS_RTOL)):
        ref_losses = ref[0][i]["losses"]
        assert len(ref_losses) == STEPS
        for rank, per_run in enumerate(got):
            assert per_run[i]["losses"] == pytest.approx(ref_losses, rel=rtol), f"run {i} rank {rank}"
    assert_updates_close(
        final_weights(tmp_path / "dp2cp2"),
        final_weights(tmp_path / "one"),
        initial_weights(single),
        UPDATE_RTOL,
    )
    assert_updates_close(
        final_weights(tmp_path / "docs-dp2cp2"),
        final_weights(tmp_path / "docs-one"),
        initial_weights(docs_single),
        DOC_UPDATE_RTOL,
    )


@pytest.fixture(scope="module")
def masked_data_path(tmp_path_factory) -> str:
    """Like ``data_path``, but every fourth example has no valid target at all (labels all -100)."""
    import datasets

    gen = torch.Generator().manual_seed(99)
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": []}
    for i in range(24):
        n = int(torch.randint(20, 65, (1,), generator=gen))
        ids = torch.randint(3, 200, (n,), generator=gen).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append([-100] * n if i % 4 == 1 else list(ids))
    path = tmp_path_factory.mktemp("data") / "masked_tokens"
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    return str(path)


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_grad_accum_matches_larger_micro_batch(tmp_path, masked_data_path):
    """cp=2: grad_accum=2 x micro_batch 1 (with gradient checkpointing) == grad_accum=1 x micro_batch 2,
    on data where some micro-batches hold no valid target (they must add 0 to the denominator)."""
    import datasets

    from ringft.train.data import example_indices

    accum = tiny_recipe(
        tmp_path / "accum",
        masked_data_path,
        parallel={"cp_size": 2},
        train={"micro_batch_size": 1, "grad_accum": 2, "gradient_checkpointing": True},
    )
    big = tiny_recipe(
        tmp_path / "big", masked_data_path, parallel={"cp_size": 2}, train={"micro_batch_size": 2}
    )
    labels = datasets.load_from_disk(masked_data_path)["labels"]
    recipe, layout = recipe_from_dict(accum), _layout(1, 2, 0)
    mixed = [  # steps where one micro-batch has targets and the other has none
        step
        for step in range(STEPS)
        if sorted(
            all(
                y == -100
                for i in example_indices(step, micro, layout, recipe, len(labels))
                for y in labels[i]
            )
            for micro in range(2)
        )
        == [False, True]
    ]
    assert mixed, "the data order must give a step with one micro-batch without any target"
    runs = [{"recipe": accum}, {"recipe": big}]
    results = run_distributed(_train_runs, 2, runs, str(tmp_path), timeout=RUN_TIMEOUT)
    for rank, (a, b) in enumerate(results):
        assert len(a["losses"]) == STEPS
        assert a["losses"] == pytest.approx(b["losses"], rel=LOSS_RTOL), f"rank {rank}"
    assert_updates_close(
        final_weights(tmp_path / "accum"), final_weights(tmp_path / "big"), initial_weights(big), UPDATE_RTOL
    )


# ---------------------------------------------------------------------------------------------
# Kill and resume
# ---------------------------------------------------------------------------------------------


def _expect_killed(runs: list[dict], store_dir: Path, rank: int) -> None:
    with pytest.raises(RuntimeError) as info:
        run_distributed(_train_runs, 2, runs, str(store_dir), timeout=RUN_TIMEOUT)
    msg = str(info.value)
    assert f"rank(s) [{rank}]" in msg and "[-9]" in msg, msg  # died of the SIGKILL, not of a bug


@pytest.mark.numerics
@pytest.mark.timeout(420)
def test_kill_and_resume(tmp_path, data_path):
    """A: 6 steps, save every 2 (world 2, cp 2). B: rank 1 SIGKILLs itself after step 3; --resume
    starts from step 2 and ends equal to A. C: rank 0 dies inside the save of step 4 (after the
    state is written, before the rename): the half-written ``.tmp`` is never a checkpoint, resume
    starts from step 2 and ends equal to A."""
    from ringft.train.checkpoint import complete_checkpoints

    def recipe(name):
        return tiny_recipe(
            tmp_path / name,
            data_path,
            parallel={"cp_size": 2},
            train={"max_steps": 6, "warmup_steps": 0},
            checkpoint={"save_every": 2, "keep": 3},
        )

    # Call 1: A uninterrupted, then B from scratch in the same processes, killed after step 3.
    record_a = tmp_path / "A.json"
    _expect_killed(
        [{"recipe": recipe("A"), "record": str(record_a)}, {"recipe": recipe("B"), "kill": "step:3:1"}],
        tmp_path / "call1",
        rank=1,
    )
    a = json.loads(record_a.read_text())
    assert len(a["losses"]) == 6
    assert [p.name for p in complete_checkpoints(tmp_path / "A")] == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]
    assert [p.name for p in complete_checkpoints(tmp_path / "B")] == ["step-00000002"]
    assert not (tmp_path / "B" / "final").exists()

    # Call 2 (fresh processes): B resumes; then C from scratch dies in the middle of saving step 4.
    record_b = tmp_path / "B.json"
    _expect_killed(
        [
            {"recipe": recipe("B"), "resume": True, "record": str(record_b)},
            {"recipe": recipe("C"), "kill": "save:4:0"},
        ],
        tmp_path / "call2",
        rank=0,
    )
    b = json.loads(record_b.read_text())
    assert b["start_step"] == 2
    assert b["losses"] == a["losses"][2:]  # same operations in the same order: exact
    assert_weights_equal(final_weights(tmp_path / "B"), final_weights(tmp_path / "A"))
    # metrics.jsonl: every step once (the rows of step 3, logged before the kill, were dropped on resume)
    rows = [json.loads(line) for line in (tmp_path / "B" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == a["losses"]

    ckpt_root = tmp_path / "C" / "checkpoints"
    assert (ckpt_root / "step-00000004.tmp").is_dir()
    assert any((ckpt_root / "step-00000004.tmp").iterdir())  # accelerate's state was written
    assert [p.name for p in complete_checkpoints(tmp_path / "C")] == ["step-00000002"]

    # Call 3 (fresh processes): C resumes from step 2, not from the half-written step 4.
    (c,) = run_distributed(
        _train_runs,
        2,
        [{"recipe": recipe("C"), "resume": True}],
        str(tmp_path / "call3"),
        timeout=RUN_TIMEOUT,
    )[0]
    assert c["start_step"] == 2
    assert c["losses"] == a["losses"][2:]
    assert_weights_equal(final_weights(tmp_path / "C"), final_weights(tmp_path / "A"))
    assert [p.name for p in complete_checkpoints(tmp_path / "C")] == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]


def test_document_masking_checks_the_offsets_at_load(tmp_path, packed_data_path):
    """data.document_masking: offsets required and checked (vectorised, across Arrow chunks) before any
    model loads; cut with a truncated row; offsets present but masking off give a note."""
    import datasets

    from ringft.train.data import check_rows

    packed, separate = packed_data_path
    recipe = lambda path, **data: recipe_from_dict(  # noqa: E731
        tiny_recipe(tmp_path / "out", path, data={"document_masking": True, **data})
    )
    good = datasets.load_from_disk(packed)
    assert len(check_rows(good, recipe(packed), VOCAB, "p").notes) == 0
    with pytest.raises(RecipeError, match="has no cu_seqlens column .*data_prep/pack.py --document-masking"):
        check_rows(datasets.load_from_disk(separate), recipe(separate), VOCAB, "s")
    note = check_rows(good, recipe(packed, document_masking=False), VOCAB, "p").notes
    assert any("cu_seqlens" in n and "data.document_masking: true" in n for n in note)
    bad = datasets.Dataset.from_dict(
        {
            "input_ids": [[5] * 10] * 5,
            "cu_seqlens": [[0, 5, 5, 10], [1, 10], [0, 9], [0], [0, 4, 10]],  # only the last is valid
        }
    )
    two_chunks = datasets.concatenate_datasets([good.select_columns(["input_ids", "cu_seqlens"]), bad])
    with pytest.raises(RecipeError, match=r"4 of 21 rows of c have document offsets .* \(first: row 16, "):
        check_rows(two_chunks, recipe(packed), VOCAB, "c")
    long = datasets.Dataset.from_dict({"input_ids": [[5] * 100], "cu_seqlens": [[0, 30, 70, 100]]})
    data = check_rows(long, recipe(packed, too_long="truncate"), VOCAB, "l")
    assert data.examples([0])[0]["cu_seqlens"] == [0, 30, 64]
    with pytest.raises(RecipeError, match="data.document_masking needs packed rows"):
        recipe_from_dict(
            tiny_recipe(tmp_path / "o", None, data={"path": None, "synthetic": {}, "document_masking": True})
        )


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_lora_trains_and_exports_a_loadable_adapter(tmp_path, data_path):
    raw = tiny_recipe(
        tmp_path / "lora",
        data_path,
        parallel={"cp_size": 2},
        train={"lr": 1e-2, "chunked_loss": True},
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )
    r0, r1 = run_distributed(_lora_worker, 2, raw, timeout=RUN_TIMEOUT)
    assert len(r0["losses"]) == 4 and r0["losses"] == r1["losses"]
    assert r0["trainable"] and all("lora_" in k for k in r0["trainable"])  # the base stays frozen
    final = tmp_path / "lora" / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # an adapter, not a full copy of the model
    assert r0["lora_keys_match"] and r0["lora_max_diff"] == 0.0
    assert r0["lora_b_norm"] > 0  # B starts at zero: non-zero means the adapter was trained
    assert r0["base_unchanged"]
    # merged vs adapted: the same logits with fp32 sums reordered in one layer's reductions
    # (hidden 32 + intermediate 64 + 32 keys): (32 + 64 + 32) * eps of the logits' scale
    assert r0["merged_vs_adapted"] <= (32 + 64 + 32) * EPS32 * r0["logits_scale"]
    assert r0["adapter_effect"] > 100 * (32 + 64 + 32) * EPS32 * r0["logits_scale"]  # far above rounding


# ---------------------------------------------------------------------------------------------
# Recipe validation and the CLI
# ---------------------------------------------------------------------------------------------


def _valid(tmp_path, **sections) -> dict:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return tiny_recipe(tmp_path / "out", data, **sections)


def test_valid_recipe_passes(tmp_path):
    recipe = recipe_from_dict(_valid(tmp_path, parallel={"cp_size": 2}))
    validate(recipe, world_size=4)
    assert recipe.train.betas == (0.9, 0.95)


def test_unknown_key_names_the_key_and_the_valid_keys(tmp_path):
    raw = _valid(tmp_path)
    raw["train"]["max_step"] = 3
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw)
    msg = str(info.value)
    assert "train.max_step" in msg and "max_steps" in msg and "micro_batch_size" in msg
    with pytest.raises(RecipeError, match="trainer"):
        recipe_from_dict({**_valid(tmp_path), "trainer": {}})


def test_seq_len_must_divide_by_twice_cp(tmp_path):
    with pytest.raises(RecipeError, match=r"seq_len=66 .*2 \* cp_size = 8.*72"):
        recipe_from_dict(_valid(tmp_path, data={"seq_len": 66}, parallel={"cp_size": 4}))


def test_missing_dataset_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(RecipeError, match="does not exist") as info:
        recipe_from_dict(_valid(tmp_path, data={"path": str(missing)}))
    assert str(missing) in str(info.value)


def test_cp_must_divide_world_size(tmp_path):
    recipe = recipe_from_dict(_valid(tmp_path, parallel={"cp_size": 2}))
    with pytest.raises(RecipeError, match=r"parallel.cp_size=2 does not divide the 3 launched processes"):
        validate(recipe, world_size=3)
    # cp 3 on 2 processes with a seq_len that 2 * 3 does not divide either: the launch is named first
    with pytest.raises(RecipeError, match=r"parallel.cp_size=3 does not divide the 2 launched processes"):
        recipe_from_dict(_valid(tmp_path, parallel={"cp_size": 3}), world_size=2)


def test_unsupported_model_type(tmp_path):
    from ringft.train.build import build_model

    raw = _valid(tmp_path, model={"model_type": "gpt2"})
    # Either the recipe check or (at the latest) building the model must refuse it, by name.
    with pytest.raises(RecipeError, match="gpt2"):
        build_model(recipe_from_dict(raw), vocab_size=300)


@pytest.mark.parametrize("which", ["both", "neither"])
def test_exactly_one_of_name_or_path_and_config(tmp_path, which):
    raw = _valid(tmp_path)
    if which == "both":
        raw["model"]["name_or_path"] = "some/model"
    else:
        del raw["model"]["config"]
    with pytest.raises(RecipeError, match="exactly one of model.name_or_path .* or model.config"):
        recipe_from_dict(raw)


@pytest.mark.timeout(120)
def test_cli_bad_recipe_exits_2_with_one_line(tmp_path):
    import yaml

    raw = _valid(tmp_path)
    raw["train"]["learning_rate"] = 1e-3
    bad = tmp_path / "BAD.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "ringft", "train", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringft train: error:") and "train.learning_rate" in lines[0]
    assert proc.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_fsdp_launch_without_gpu_is_refused_not_silently_dropped(tmp_path):
    """accelerate runs FSDP only on accelerators: without a GPU an FSDP launch config must fail
    with a clear error instead of training unsharded (what accelerate's cpu=True would do)."""
    import yaml

    recipe = tmp_path / "ok.yaml"
    recipe.write_text(yaml.safe_dump(_valid(tmp_path)))
    env = dict(os.environ, ACCELERATE_USE_FSDP="true")
    proc = subprocess.run(
        [sys.executable, "-m", "ringft", "train", str(recipe)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "FSDP launch config needs GPUs" in proc.stderr and "cpu_2proc.yaml" in proc.stderr
