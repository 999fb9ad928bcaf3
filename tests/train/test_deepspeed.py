"""The trainer under DeepSpeed ZeRO-3 (with and without CPU offload), launched exactly as a user
launches it: ``accelerate launch --config_file recipes/accelerate/deepspeed_zero3*.yaml -m ringft
train``. DeepSpeed runs on its CPU accelerator over gloo here (``pip install deepspeed``; the
dev extra installs it), so the same trainer code paths run as on GPUs: parameters partitioned at
construction (the shipped ``zero3_init_flag: true``), the engine's own gradient accumulation and
clipping, the partitioned ``lm_head`` read by the chunked loss through its module hooks (gathered
once per forward), weight decay on the partitioned matrices, DeepSpeed checkpoints (the Trainer's
``checkpoint-N/global_stepN``, complete once ``ringft_run.json`` is written), and the gathered state
dict at export. Every run, the references too, goes through ``ringft train``
(transformers' Trainer with the ring mixin).

Oracle: the same recipe on one plain process (no DeepSpeed, no ring, full-logits loss) with the
same global batch, starting from the same saved model folder (``from_pretrained``: under
``zero.Init`` a model built *from config* would get another random initialisation). The launch
configs are the shipped ones with one key changed for the test: ``mixed_precision: "no"`` (fp32,
so that the round-off bounds below hold).

Tolerances: those of tests/tiny_training.py (LOSS_RTOL per step, UPDATE_RTOL on the weights' update
relative to its norm; both from eps32 x the reduction lengths x steps): the runs only reorder fp32
sums, while a wrong loss scale under DeepSpeed's ``1 / gradient_accumulation_steps`` changes the
gradient norm by 2x, and weight decay left off (wd 0.5 at lr 1e-3) changes the update by ~1 %. The
offload run uses DeepSpeedCPUAdam (vectorised fp32 Adam): the same bound. Resuming a DeepSpeed
checkpoint replays the same operations: bit-exact.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ringft.utils.spawn import free_port, run_distributed
from tests.tiny_training import (
    LOSS_RTOL,
    RUN_TIMEOUT,
    UPDATE_RTOL,
    VOCAB,
    assert_updates_close,
    assert_weights_equal,
    final_weights,
    tiny_recipe,
)
from tests.train.launch_env import (
    BUILD_TIMEOUT,
    EXTENSIONS_DIR,
    finish_deepspeed_build,
    launch_env,
    start_deepspeed_build,
)
from tests.train.moe_runs import (
    MOE_LOSS_RTOL,
    MOE_UPDATE_RTOL,
    expert_parameter_names,
    moe_recipe,
    save_moe,
    transformers_first_step_loss,
)
from tests.workers import train_runs

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 420
# DeepSpeed's CPU ops are built once, in one process, under a timeout, into this clone's folder
# (tests/train/launch_env.py says why: a build killed mid-way leaves a lock every launch waits on).
DEEPSPEED_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def _launch_config(tmp_path: Path, name: str, num_processes: int) -> Path:
    cfg = yaml.safe_load((REPO / "recipes" / "accelerate" / name).read_text())
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["deepspeed_config"]["zero_stage"] == 3
    assert cfg["deepspeed_config"]["zero3_init_flag"] is True  # tested as shipped
    cfg["mixed_precision"] = "no"
    cfg["num_processes"] = num_processes
    cfg["main_process_port"] = free_port()
    path = tmp_path / f"launch-{name}"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(tmp_path: Path, launch_config: Path, raw: dict, *extra: str) -> None:
    recipe = tmp_path / f"recipe-{Path(raw['checkpoint']['output_dir']).name}.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(launch_config),
        "-m",
        "ringft",
        "train",
        str(recipe),
        "--no-progress",
        *extra,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "ringft: " in proc.stdout, proc.stdout[-3000:]


def _metric(output_dir: Path, key: str = "loss") -> list[float]:
    """One column of the run's metrics.jsonl, in step order."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """tiny_recipe's model (seeded init), saved as a pretrained folder."""
    from ringft.train.build import build_model
    from ringft.train.recipe import recipe_from_dict

    path = tmp_path_factory.mktemp("model") / "tiny"
    build_model(
        recipe_from_dict(tiny_recipe("unused", None, data={"path": None, "synthetic": {}})), vocab_size=VOCAB
    ).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """tests/train/moe_runs.py's tiny Qwen3-MoE (router load-balancing loss on), saved."""
    return save_moe(tmp_path_factory.mktemp("model") / "moe")


def pretrained_recipe(output_dir: Path, data: str, model: str, **sections) -> dict:
    """tiny_recipe reading its model from ``model`` (a saved folder) instead of building it."""
    raw = tiny_recipe(output_dir, data, **sections)
    for key in ("config", "model_type"):
        raw["model"].pop(key)
    raw["model"]["name_or_path"] = model
    return raw


def initial(model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model) / "model.safetensors"))


WEIGHT_DECAY = {"weight_decay": 0.5}  # decays by lr * 0.5 * w = ~1 % of an AdamW step at lr 1e-3


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
LORA_TRAIN = {"lr": 1e-2, "chunked_loss": True}


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_path, model_dir, moe_dir) -> Path:
    """The one-process references of every test here, in one 1-process spawn (the same recipe for
    the ZeRO-3 and the offload runs: ``one``; the LoRA run: ``one-lora`` with its starting adapter
    ``adapter-start.safetensors``; the MoE run: ``one-moe``), computed while DeepSpeed's CPU
    all-reduce and CPU Adam build in a background process on the other core (launch_env: stale
    locks cleared, the build under a timeout, in one process); both are done before any launch."""
    root = tmp_path_factory.mktemp("references")
    build = start_deepspeed_build(DEEPSPEED_OPS)
    try:
        single = pretrained_recipe(
            root / "one", data_path, model_dir, train={"micro_batch_size": 4, **WEIGHT_DECAY}
        )
        lora = pretrained_recipe(root / "one-lora", data_path, model_dir, train=LORA_TRAIN, lora=LORA)
        runs = [
            {"recipe": single},
            {"recipe": lora, "initial_adapter": str(root / "adapter-start.safetensors")},
            {"recipe": moe_recipe(root / "one-moe", data_path, moe_dir, dp=1, cp=1)},
        ]
        results = run_distributed(train_runs, 1, runs, str(root), timeout=RUN_TIMEOUT)[0]
    finally:
        try:
            finish_deepspeed_build(build)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"DeepSpeed CPU op build took over {BUILD_TIMEOUT} s (held lock in {EXTENSIONS_DIR}?)"
            )
        except RuntimeError as exc:
            pytest.fail(f"DeepSpeed CPU op build failed: {exc}")
    (root / "losses.json").write_text(json.dumps([r["losses"] for r in results]))
    return root


def _reference_losses(root: Path, index: int) -> list[float]:
    return json.loads((root / "losses.json").read_text())[index]


def _zero3_recipe(output_dir: Path, data: str, model: str) -> dict:
    """dp=2 x cp=2 on 4 ranks, micro-batch 1 x grad_accum 2 (global batch 4), chunked loss reading
    the partitioned lm_head, gradient checkpointing, weight decay, a checkpoint every 2 steps."""
    return pretrained_recipe(
        output_dir,
        data,
        model,
        parallel={"cp_size": 2},
        train={
            "micro_batch_size": 1,
            "grad_accum": 2,
            "chunked_loss": True,
            "gradient_checkpointing": True,
            **WEIGHT_DECAY,
        },
        checkpoint={"save_every": 2, "keep": 3},
    )


@pytest.mark.numerics
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT)
def test_zero3_matches_one_process_and_resumes(tmp_path, data_path, model_dir, references):
    """ZeRO-3 with the shipped zero3_init_flag (dp=2 x cp=2, grad_accum 2, weight decay 0.5) == one
    process on the same global batch: losses, gradient norms and the exported weights' update; then
    --resume from the step-2 DeepSpeed checkpoint ends at the same weights."""
    ref_losses, ref_weights = _reference_losses(references, 0), final_weights(references / "one")
    launch = _launch_config(tmp_path, "deepspeed_zero3.yaml", 4)
    out = tmp_path / "zero3"
    _launch(tmp_path, launch, _zero3_recipe(out, data_path, model_dir))
    losses = _metric(out)
    assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    # DeepSpeed's global gradient norm (what it clips with) == the one-process norm: the gradients'
    # relative error over the steps (UPDATE_RTOL); a wrong accumulation scale would be 2x.
    assert _metric(out, "grad_norm") == pytest.approx(
        _metric(references / "one", "grad_norm"), rel=UPDATE_RTOL
    )
    weights = final_weights(out)
    assert_updates_close(weights, ref_weights, initial(model_dir), UPDATE_RTOL)
    step2 = out / "checkpoint-2"
    assert (step2 / "global_step2").is_dir(), sorted(p.name for p in step2.iterdir())  # ZeRO shards

    # Resume: keep only the step-2 checkpoint, train steps 3 and 4 again.
    again = tmp_path / "zero3-resumed"
    shutil.copytree(out, again, ignore=shutil.ignore_patterns("final", "metrics.jsonl", "logs"))
    shutil.rmtree(again / "checkpoint-4")
    _launch(tmp_path, launch, _zero3_recipe(again, data_path, model_dir), "--resume")
    assert _metric(again) == losses[2:]  # the same operations in the same order: exact
    assert_weights_equal(final_weights(again), weights)


@pytest.mark.numerics
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_zero3_cpu_offload_matches_one_process(tmp_path, data_path, model_dir, references):
    """ZeRO-3 with optimizer and parameters offloaded to CPU memory (DeepSpeedCPUAdam, which
    accelerate swaps in for AdamW; the learning-rate schedule must reach it): dp=1 x cp=2, micro 2
    x grad_accum 2 == one process with micro 4. Run through ``ringft train`` (transformers'
    Trainer with the ring mixin; the recipe's accumulation and clipping replace the launch
    config's)."""
    ref_losses, ref_weights = _reference_losses(references, 0), final_weights(references / "one")
    raw = pretrained_recipe(
        tmp_path / "offload",
        data_path,
        model_dir,
        parallel={"cp_size": 2},
        train={"micro_batch_size": 2, "grad_accum": 2, "chunked_loss": True, **WEIGHT_DECAY},
    )
    _launch(tmp_path, _launch_config(tmp_path, "deepspeed_zero3_offload.yaml", 2), raw)
    assert _metric(tmp_path / "offload") == pytest.approx(ref_losses, rel=LOSS_RTOL)
    assert_updates_close(final_weights(tmp_path / "offload"), ref_weights, initial(model_dir), UPDATE_RTOL)


@pytest.mark.numerics
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_zero3_lora_matches_one_process(tmp_path, data_path, model_dir, references):
    """LoRA (q/v) under ZeRO-3, dp=1 x cp=2: losses and the exported adapter's update == one process."""
    from safetensors.torch import load_file

    raw = pretrained_recipe(
        tmp_path / "lora", data_path, model_dir, parallel={"cp_size": 2}, train=LORA_TRAIN, lora=LORA
    )
    _launch(tmp_path, _launch_config(tmp_path, "deepspeed_zero3.yaml", 2), raw)
    assert _metric(tmp_path / "lora") == pytest.approx(_reference_losses(references, 1), rel=LOSS_RTOL)
    got = load_file(str(tmp_path / "lora" / "final" / "adapter_model.safetensors"))
    want = load_file(str(references / "one-lora" / "final" / "adapter_model.safetensors"))
    assert any("lora_B" in k for k in got)
    assert_updates_close(got, want, load_file(str(references / "adapter-start.safetensors")), UPDATE_RTOL)


def _zero3_layout(checkpoint: Path, world: int) -> tuple[list[int], dict[str, int], int]:
    """From a ZeRO-3 checkpoint: per rank, the entries of its fp32 partition; the model's parameter
    shapes (as trained: transformers' fused experts) as numels; the run's
    ``stage3_param_persistence_threshold`` (smaller parameters stay whole on every rank between
    forwards; larger ones are gathered by their module's hooks)."""
    folder = checkpoint
    files = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))
    assert len(files) == world, sorted(p.name for p in folder.iterdir())
    sizes = []
    for f in files:
        state = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        sizes.append(sum(t.numel() for t in state["fp32_flat_groups"]))
    model = torch.load(
        next(folder.glob("*zero_pp_rank_0_*model_states.pt")), map_location="cpu", weights_only=False
    )
    numels = {k: torch.Size(v).numel() for group in model["param_shapes"] for k, v in group.items()}
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = DeepSpeedZeroConfig(**model["ds_config"]["zero_optimization"])
    return sizes, numels, int(zero.param_persistence_threshold)


@pytest.mark.numerics
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_zero3_moe_router_loss_matches_one_process(tmp_path, data_path, moe_dir, references):
    """A Qwen3-MoE with its router load-balancing loss (tests/train/moe_runs.py) under ZeRO-3 at
    dp=2 x cp=2 (grad_accum 2, chunked loss on the partitioned lm_head, gradient checkpointing) ==
    one process (grad_accum 4): the logged losses (token loss + 0.5 x the term per micro-batch; the
    first step's also == transformers' own forward loss), the grad norms, and the exported update of
    every weight, the experts and routers included; the experts are partitioned over the 4 ranks."""
    from safetensors.torch import load_file

    one = references / "one-moe"
    out = tmp_path / "zero3-moe"
    raw = moe_recipe(out, data_path, moe_dir, dp=2, cp=2, gradient_checkpointing=True)
    raw["checkpoint"]["save_every"] = raw["train"]["max_steps"]  # the last step's shards, read below
    _launch(tmp_path, _launch_config(tmp_path, "deepspeed_zero3.yaml", 4), raw)
    ref = _reference_losses(references, 2)
    assert ref[0] == pytest.approx(transformers_first_step_loss(moe_dir, data_path), rel=MOE_LOSS_RTOL)
    assert _metric(out) == pytest.approx(ref, rel=MOE_LOSS_RTOL)
    assert _metric(out, "grad_norm") == pytest.approx(_metric(one, "grad_norm"), rel=MOE_UPDATE_RTOL)
    start = load_file(str(Path(moe_dir) / "model.safetensors"))
    got, want = final_weights(out), final_weights(one)
    assert len(expert_parameter_names(want)) == 2 * (4 * 3 + 1)  # 2 layers x (4 experts x 3 + router)
    assert_updates_close(got, want, start, MOE_UPDATE_RTOL)
    for name in expert_parameter_names(want):  # every expert and router trained
        assert not torch.equal(want[name], start[name]), name
    sizes, numels, persist = _zero3_layout(out / "checkpoint-4" / "global_step4", 4)
    assert sizes == [sum(-(-n // 4) for n in numels.values())] * 4, (sizes, numels)  # each cut in 4
    experts = {k: n for k, n in numels.items() if ".mlp.experts." in k}
    assert len(experts) == 2 * 2 and min(experts.values()) > persist, (experts, persist)
