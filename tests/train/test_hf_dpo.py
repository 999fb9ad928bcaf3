"""``RingDPOTrainer`` (TRL's ``DPOTrainer`` on the ring) against one ``DPOTrainer`` process, on gloo
CPU processes (tiny fp32 LLaMA, tests/train/trl_runs.py).

One 4-process spawn, shared with test_hf_grpo.py (tests/train/conftest.py): the ranks first run
one-process references on their own (no process group), then all four run the ring trainers together:

- dp 2 x cp 2, sigmoid loss with an explicit reference model, evaluated after training, against
  one process with twice the micro-batch (DDP over dp 2 averages the two replicas' mean losses over
  the first and second half of each of those batches: the same update and metrics);
- dp 1 x cp 4 (every row sharded over 4 ranks: prompts of 8..24 tokens, completions 2..12), IPO
  + SFT losses with precomputed reference log-probs (no reference model: the policy before
  training, scored on the ring), micro-batch 1 x gradient accumulation 2, against one process;
- a refusal: ``compute_metrics`` (it needs the logits);
- DeepSpeed ZeRO-3 through the recipe script: recipes/trl_dpo/dpo.py launched with the shipped
  recipes/accelerate/deepspeed_zero3.yaml (``zero3_init_flag`` on; ``--num_processes 2``, cp 2,
  ``--mixed_precision no`` for fp32 on CPU), full fine-tuning of the tiny LLaMA with the reference
  model TRL loads and prepares as a ZeRO-3 inference engine (both partitioned, both on the ring, the
  partitioned ``lm_head`` gathered by TRL's fused head), against the same script in one process
  (``--cp_size 1``: TRL's DPOTrainer, run in the spawn above): every logged metric each step and
  the exported weights' update; and the same with the reference log-probs precomputed
  (``--precompute_ref_log_probs true``, recipes/trl_dpo/run.sh's setting) against the same
  one-process run (the reference is the policy before training either way). DeepSpeed builds its
  CPU ops first (tests/train/launch_env.py).

Tolerances: the runs compute the same fp32 math, the attention in another order (ring vs sdpa) and
the gradients summed over CP ranks. A sequence log-probability sums at most 64 token log-probs, each
a log-softmax over VOCAB logits; the DPO losses, rewards and margins are smooth functions of those
sums: LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * eps32 (tests/train/hf_runs.py) relative on every
logged value, and on the rewards (differences of two such sums) that bound times the sums'
magnitude. The bugs these tests exist for are far outside: a sequence summed over one shard instead
of the CP group (half the log-probs), metrics gathered over every rank (num_tokens x cp), the
gradient not scaled for the CP ranks (grad_norm x 1/cp), a batch read twice or skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ringft.utils.spawn import free_port
from tests.train.hf_runs import LOSS_RTOL, STEPS, assert_updates_close
from tests.train.launch_env import launch_env
from tests.train.trl_runs import METRICS, dpo_zero3_argv

pytestmark = pytest.mark.filterwarnings("ignore")
BETA = 0.5  # tests/train/trl_runs.py
REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 420


@pytest.fixture(scope="module")
def dpo(trl_runs_4) -> dict[str, dict]:
    return {k[len("dpo/") :]: v for k, v in trl_runs_4.items() if k.startswith("dpo/")}


def assert_same_dpo(got: dict, ref: dict) -> None:
    assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
    assert_same_dpo_logs(got["logs"], ref["logs"])
    assert_updates_close(got["final"], ref["final"], ref["initial"], STEPS * LOSS_RTOL)
    assert got["tokens_seen"] == ref["tokens_seen"]


def assert_same_dpo_logs(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref) == 2
    for g, o in zip(got, ref):
        assert sorted(g) == sorted(o)
        scale = max(abs(o["logps/chosen"]), abs(o["logps/rejected"]))
        for key, want in o.items():
            if key.startswith("rewards/") and key != "rewards/accuracies":
                assert g[key] == pytest.approx(want, abs=BETA * LOSS_RTOL * scale), key
            elif key.startswith(
                "logits/"
            ):  # means over the vocabulary: ~1e-3, cancelling sums of O(1) logits
                assert g[key] == pytest.approx(want, abs=LOSS_RTOL), key
            else:
                assert g[key] == pytest.approx(
                    want, rel=STEPS * LOSS_RTOL if key == "grad_norm" else LOSS_RTOL
                ), key


@pytest.mark.numerics
@pytest.mark.timeout(660)
def test_dp2_cp2_sigmoid_with_reference_model(dpo):
    """dp 2 x cp 2 == one process (2x micro-batch): loss, grad norm, rewards, log-probs, logits,
    entropy, token accuracy, num_tokens every step; the weight update; the eval metrics; every rank
    logs the same."""
    assert_same_dpo(dpo["sig"], dpo["one-sig"])
    for rank in (1, 2, 3):
        assert dpo[f"sig@{rank}"]["logs"] == dpo["sig"]["logs"]
    got, ref = dpo["sig"]["eval"], dpo["one-sig"]["eval"]
    for key in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_rewards/accuracies"):
        assert got[key] == pytest.approx(ref[key], rel=LOSS_RTOL), key
    assert got["eval_rewards/margins"] == pytest.approx(
        ref["eval_rewards/margins"], abs=BETA * LOSS_RTOL * abs(ref["eval_logps/chosen"])
    )


@pytest.mark.numerics
@pytest.mark.timeout(660)
def test_cp4_ipo_sft_precomputed_reference(dpo):
    """cp 4 (each row sharded over 4 ranks), IPO + SFT losses, reference log-probs precomputed on
    the ring, gradient accumulation 2 == one process."""
    assert_same_dpo(dpo["ipo"], dpo["one-ipo"])


@pytest.mark.timeout(660)
def test_compute_metrics_refused(dpo):
    """What needs the logits is refused at construction, in one line, on every rank."""
    for rank in range(4):
        err = dpo["refused" if rank == 0 else f"refused@{rank}"].get("error", "")
        assert "compute_metrics" in err and "\n" not in err, err


def _pairs_file(path: Path) -> str:
    """The recipe's ``synthetic-pairs:8`` rows (its default seed 42) as a .jsonl file: TRL caches the
    precomputed reference log-probs next to the dataset's files, which an in-memory dataset has
    only in a temporary folder of each process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_dpo_pairs", REPO / "recipes" / "trl_dpo" / "dpo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    path.write_text("".join(json.dumps(row) + "\n" for row in module.synthetic_pairs(8, 42)))
    return str(path)


@pytest.mark.numerics
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("reference", ["model", "precomputed"])
def test_zero3_recipe_script_matches_one_process(dpo, hf_root, tmp_path, deepspeed_ops, reference):
    """recipes/trl_dpo/dpo.py under the shipped ZeRO-3 config (2 ranks, cp 2, full fine-tuning) ==
    the script in one process: metrics every step, weights. The reference: the model TRL loads
    (partitioned too, its own inference engine), or its log-probs precomputed on the ring through
    TRL's inference engine on the policy (recipes/trl_dpo/run.sh's setting); both are the policy
    before training, as in the one-process run."""
    from safetensors.torch import load_file

    out = tmp_path / "zero3"
    launch = [
        *(str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file"),
        str(REPO / "recipes" / "accelerate" / "deepspeed_zero3.yaml"),
        *("--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(free_port())),
        str(REPO / "recipes" / "trl_dpo" / "dpo.py"),
    ]
    argv = [*launch, *dpo_zero3_argv(str(hf_root / "tiny"), str(out)), "--cp_size", "2"]
    if reference == "precomputed":
        argv[argv.index("synthetic-pairs:8")] = _pairs_file(tmp_path / "pairs.jsonl")
        argv += ["--precompute_ref_log_probs", "true"]
    env = launch_env(HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads((out / "run_info.json").read_text())
    assert info == {
        "world": 2,
        "dp": 1,
        "cp": 2,
        "ulysses": 1,
        "distributed_type": "DistributedType.DEEPSPEED",
    }
    ref = dpo["one-zero3"]
    assert "error" not in ref, ref["error"]
    history = json.loads((out / "log_history.json").read_text())
    assert_same_dpo_logs([{k: h[k] for k in METRICS if k in h} for h in history if "loss" in h], ref["logs"])
    initial = load_file(str(hf_root / "tiny" / "model.safetensors"))
    want = load_file(str(Path(ref["out"]) / "final" / "model.safetensors"))
    got = load_file(str(out / "final" / "model.safetensors"))
    assert_updates_close(got, want, initial, STEPS * LOSS_RTOL)
