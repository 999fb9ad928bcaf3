"""``ringft train`` (transformers' Trainer with the ring mixin,
:mod:`ringft.train.front`) end to end on gloo CPU processes: DP x CP equivalence, gradient
accumulation, kill-and-resume (also mid-save), the document-offsets check at load, LoRA export.

The tiny training (model, random-token data, recipe) and its tolerances LOSS_RTOL / UPDATE_RTOL,
derived from eps32 x the reduction lengths x steps, are described in tests/tiny_training.py; the
ranks' side (several runs per ``run_distributed`` call, fresh process groups between them, injected
SIGKILLs) in tests/workers.py. The recipe schema and the CLI's error path: test_recipe_schema.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringft.train.recipe import RecipeError, recipe_from_dict
from ringft.utils.spawn import run_distributed
from tests.tiny_training import (
    EPS32,
    LOSS_RTOL,
    RUN_TIMEOUT,
    STEPS,
    TOKENS_PER_STEP,
    UPDATE_RTOL,
    VOCAB,
    assert_updates_close,
    assert_weights_equal,
    final_weights,
    initial_weights,
    tiny_recipe,
)
from tests.workers import fresh_group, one_thread, train_runs

# ---------------------------------------------------------------------------------------------
# Workers (module level: run_distributed spawns and imports this module)
# ---------------------------------------------------------------------------------------------


def _lora_worker(rank: int, world: int, raw: dict) -> dict:
    from peft import PeftModel

    from ringft.train import front
    from ringft.train.build import build_model

    one_thread()
    recipe = recipe_from_dict(raw)
    trainer, folder = front.build_trainer(recipe, progress=False)
    try:
        res = front._run(trainer, folder, recipe)
    finally:
        folder.release()
    out: dict = {"losses": res.losses}
    if rank != 0:
        return out
    trained = trainer.accelerator.unwrap_model(trainer.model)
    lora_trained = {k: v.detach().clone() for k, v in trained.named_parameters() if "lora_" in k}
    out["trainable"] = sorted(k for k, v in trained.named_parameters() if v.requires_grad)
    # The frozen base weights did not move: compare with a freshly built (same seed) base model.
    base = build_model(recipe, vocab_size=len(trainer.processing_class))
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


def _runs_then_lora(rank: int, world: int, runs: list[dict], store_dir: str, lora_raw: dict) -> dict:
    """``train_runs(runs)``, then ``_lora_worker(lora_raw)`` in the same processes (a fresh group):
    the 2-rank runs of test_grad_accum_matches_larger_micro_batch and the LoRA test share one
    process start."""
    results = train_runs(rank, world, runs, store_dir)
    fresh_group(store_dir, len(runs), rank, world)
    return {"runs": results, "lora": _lora_worker(rank, world, lora_raw)}


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
    no shuffling, so both read the documents in the same steps).

    Ulysses x ring in the same spawn (``parallel.ulysses_size``): dp 1 x (ulysses 2 x ring 2) with
    the micro batch of 4 against the same one-process run, and dp 2 x (ulysses 2 x ring 1) on the
    packed rows against the one-process documents run; same tolerances."""
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
    hybrid = tiny_recipe(
        tmp_path / "u2r2",
        data_path,
        parallel={"cp_size": 4, "ulysses_size": 2},
        train={"micro_batch_size": 4, "chunked_loss": True},
    )
    docs_hybrid = tiny_recipe(
        tmp_path / "docs-dp2u2",
        packed,
        data={"shuffle": False, "document_masking": True},
        parallel={"cp_size": 2, "ulysses_size": 2},
    )
    runs = [{"recipe": ring}, {"recipe": docs_ring}, {"recipe": hybrid}, {"recipe": docs_hybrid}]
    got = run_distributed(train_runs, 4, runs, str(tmp_path / "four"), timeout=RUN_TIMEOUT)
    runs = [{"recipe": single}, {"recipe": docs_single}]
    ref = run_distributed(train_runs, 1, runs, str(tmp_path / "one-proc"), timeout=RUN_TIMEOUT)
    for i, j, rtol in ((0, 0, LOSS_RTOL), (1, 1, DOC_LOSS_RTOL), (2, 0, LOSS_RTOL), (3, 1, DOC_LOSS_RTOL)):
        ref_losses = ref[0][j]["losses"]
        assert len(ref_losses) == STEPS
        for rank, per_run in enumerate(got):
            assert per_run[i]["losses"] == pytest.approx(ref_losses, rel=rtol), f"run {i} rank {rank}"
    for name, reference, raw, rtol in (
        ("dp2cp2", "one", single, UPDATE_RTOL),
        ("docs-dp2cp2", "docs-one", docs_single, DOC_UPDATE_RTOL),
        ("u2r2", "one", single, UPDATE_RTOL),
        ("docs-dp2u2", "docs-one", docs_single, DOC_UPDATE_RTOL),
    ):
        assert_updates_close(
            final_weights(tmp_path / name), final_weights(tmp_path / reference), initial_weights(raw), rtol
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


def _accum_recipes(root: Path, data: str) -> tuple[dict, dict]:
    accum = tiny_recipe(
        root / "accum",
        data,
        parallel={"cp_size": 2},
        # attention_checkpoint save: the recompute takes the ring outputs the forward kept
        train={
            "micro_batch_size": 1,
            "grad_accum": 2,
            "gradient_checkpointing": True,
            "attention_checkpoint": "save",
        },
    )
    big = tiny_recipe(root / "big", data, parallel={"cp_size": 2}, train={"micro_batch_size": 2})
    return accum, big


def _lora_recipe(root: Path, data: str) -> dict:
    return tiny_recipe(
        root / "lora",
        data,
        parallel={"cp_size": 2},
        train={"lr": 1e-2, "chunked_loss": True},
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    )


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, data_path, masked_data_path) -> tuple[Path, list[dict], list[list[dict]]]:
    """One 2-rank spawn for two tests: the grad-accum pair (``accum``, ``big``), then the LoRA run.
    Returns the runs' folder, per rank the LoRA result, and per rank the two runs' results."""
    root = tmp_path_factory.mktemp("two-rank")
    runs = [{"recipe": r} for r in _accum_recipes(root, masked_data_path)]
    results = run_distributed(
        _runs_then_lora, 2, runs, str(root / "store"), _lora_recipe(root, data_path), timeout=2 * RUN_TIMEOUT
    )
    return root, [r["lora"] for r in results], [r["runs"] for r in results]


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_grad_accum_matches_larger_micro_batch(two_rank_runs, masked_data_path):
    """cp=2: grad_accum=2 x micro_batch 1 (with gradient checkpointing, attention_checkpoint save) ==
    grad_accum=1 x micro_batch 2, on data where some micro-batches hold no valid target (they must
    add 0 to the denominator)."""
    import datasets

    from ringft.train.data import epoch_permutation

    root, _, results = two_rank_runs
    accum, big = _accum_recipes(root, masked_data_path)
    labels = datasets.load_from_disk(masked_data_path)["labels"]
    seed = recipe_from_dict(accum).train.seed
    order = epoch_permutation(len(labels), seed, 0).tolist()  # (STEPS x 2 rows < one epoch)
    mixed = [  # steps where one micro-batch (one row, dp 1) has targets and the other has none
        step
        for step in range(STEPS)
        if sorted(all(y == -100 for y in labels[order[2 * step + micro]]) for micro in range(2))
        == [False, True]
    ]
    assert mixed, "the data order must give a step with one micro-batch without any target"
    for rank, (a, b) in enumerate(results):
        assert len(a["losses"]) == STEPS
        assert a["losses"] == pytest.approx(b["losses"], rel=LOSS_RTOL), f"rank {rank}"
    assert_updates_close(
        final_weights(root / "accum"), final_weights(root / "big"), initial_weights(big), UPDATE_RTOL
    )


# ---------------------------------------------------------------------------------------------
# Kill and resume
# ---------------------------------------------------------------------------------------------


def _expect_killed(runs: list[dict], store_dir: Path, rank: int) -> None:
    with pytest.raises(RuntimeError) as info:
        run_distributed(train_runs, 2, runs, str(store_dir), timeout=RUN_TIMEOUT)
    msg = str(info.value)
    assert f"rank(s) [{rank}]" in msg and "[-9]" in msg, msg  # died of the SIGKILL, not of a bug


def _complete(output_dir: Path) -> list[str]:
    """The checkpoints ``--resume`` may continue from: ``checkpoint-N`` holding ``ringft_run.json``."""
    from ringft.train.front_runs import RUN_FILE, checkpoint_folders

    return [p.name for p in checkpoint_folders(output_dir) if (p / RUN_FILE).is_file()]


@pytest.mark.numerics
@pytest.mark.timeout(420)
def test_kill_and_resume(tmp_path, data_path):
    """A: 6 steps, save every 2 (world 2, cp 2). B: rank 1 SIGKILLs itself after step 3; --resume
    starts from step 2 (mid-epoch) and ends equal to A. C: rank 0 dies inside the save of step 4
    (after every rank wrote ``checkpoint-4``, before ``ringft_run.json`` marks it complete): the
    half-finished folder is never a checkpoint (``--resume`` names it damaged: tests/train/
    test_faults_train.py); ``--resume C/checkpoint-2`` ends equal to A."""

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
    assert _complete(tmp_path / "A") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert _complete(tmp_path / "B") == ["checkpoint-2"]
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

    cut = tmp_path / "C" / "checkpoint-4"
    assert cut.is_dir() and any(cut.iterdir())  # every rank's state was written
    assert _complete(tmp_path / "C") == ["checkpoint-2"]

    # Call 3 (fresh processes): C resumes from checkpoint-2, not from the half-finished step 4.
    (c,) = run_distributed(
        train_runs,
        2,
        [{"recipe": recipe("C"), "resume": str(tmp_path / "C" / "checkpoint-2")}],
        str(tmp_path / "call3"),
        timeout=RUN_TIMEOUT,
    )[0]
    assert c["start_step"] == 2
    assert c["losses"] == a["losses"][2:]
    assert_weights_equal(final_weights(tmp_path / "C"), final_weights(tmp_path / "A"))
    assert _complete(tmp_path / "C") == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


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
@pytest.mark.timeout(600)
def test_lora_trains_and_exports_a_loadable_adapter(two_rank_runs):
    """LoRA on cp=2 (run in the 2-rank spawn of ``two_rank_runs``, after the grad-accum pair)."""
    root, (r0, r1), _ = two_rank_runs
    assert len(r0["losses"]) == 4 and r0["losses"] == r1["losses"]
    assert r0["trainable"] and all("lora_" in k for k in r0["trainable"])  # the base stays frozen
    final = root / "lora" / "final"
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
