"""``RingGRPOTrainer`` (TRL's ``GRPOTrainer`` on the ring) against one ``GRPOTrainer`` process, on
gloo CPU processes (tiny fp32 LLaMA, tests/train/trl_runs.py's ``grpo_run``).

One 4-process spawn, shared with test_hf_dpo.py (tests/train/conftest.py): each rank first runs
some one-process references on its own (no process group), then all four run the ring trainers
together. Generation is replaced at TRL's generation
boundary (``_generate_single_turn``) by fixed completions, so both runs score the same rows, except
in the generation run. Every run: 2 optimizer steps on one generation (``num_iterations`` 2: the
second step's importance ratio is not 1, so the clipping is exercised), the reference model loaded
by TRL when ``beta > 0``.

- dp 1 x cp 4, prompts of 40..64 tokens (GRPO_LONG) (a row of up to 76 tokens sharded over 4 ranks: each
  rank holds less than a prompt), for each loss type grpo, bnpo, dr_grpo, dapo, with the KL term
  (beta 0.1) and without (beta 0: no reference model);
- dp 2 x cp 2, grpo + KL, against one process with twice the micro-batch (the rewards gathered and
  the advantages sliced over the DP group: group normalisation over each prompt's completions);
- dp 2 x cp 2 with real greedy generation (every rank generates, the CP group's first rank's
  completions are used): the same completions, rewards and metrics as one process;
- a refusal: ``rollout_func`` (it runs per process).

Tolerances: as tests/train/test_hf_dpo.py (the same fp32 math, attention in another order):
LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * eps32 relative on the loss, entropy and KL (each a mean
of per-token log-softmax values over VOCAB logits, sums of at most 4 x 76 tokens), absolute
LOSS_RTOL on the loss (it is a difference of advantage-weighted ratios that cancel to ~1e-2) and
the KL (a difference of two log-probs of magnitude <= log VOCAB, squared to first order);
STEPS x LOSS_RTOL on the grad norm and the weight update. The rewards, completion lengths,
token counts and clip ratios are compared exactly: the rewards are rule-based on the same
completions, and a clip-ratio count flips only for a ratio within ~1e-6 of 1 +- epsilon. The bugs
these tests exist for are far outside: log-probs summed over one shard, advantages sliced by world
rank (another replica's rows), metrics gathered over every rank (num_tokens x cp), the dapo
normaliser divided by the world instead of dp, the gradient not scaled for the CP ranks.
"""

from __future__ import annotations

import pytest

from tests.train.hf_runs import LOSS_RTOL, STEPS, assert_updates_close
from tests.train.trl_runs import GRPO_LOSSES

pytestmark = pytest.mark.filterwarnings("ignore")
# every loss type with the KL term and without (dapo's normaliser counts processes)
LOSSES = GRPO_LOSSES
EXACT = ("reward", "reward_std", "frac_reward_zero_std", "num_tokens")


@pytest.fixture(scope="module")
def grpo(trl_runs_4) -> dict[str, dict]:
    return {k[len("grpo/") :]: v for k, v in trl_runs_4.items() if k.startswith("grpo/")}


def assert_same_grpo(got: dict, ref: dict, weights: bool = True) -> None:
    assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
    assert len(got["logs"]) == len(ref["logs"]) == 2
    for g, o in zip(got["logs"], ref["logs"]):
        assert sorted(g) == sorted(o)
        for key, want in o.items():
            if key in EXACT or key.startswith(("completions/", "clip_ratio/", "rewards/")):
                assert g[key] == want, key
            elif key in ("loss", "kl"):
                assert g[key] == pytest.approx(want, rel=LOSS_RTOL, abs=LOSS_RTOL), key
            else:
                assert g[key] == pytest.approx(
                    want, rel=STEPS * LOSS_RTOL if key == "grad_norm" else LOSS_RTOL
                ), key
    if weights:
        assert_updates_close(got["final"], ref["final"], ref["initial"], STEPS * LOSS_RTOL)
    assert got["tokens_seen"] == ref["tokens_seen"]


@pytest.mark.numerics
@pytest.mark.timeout(660)
@pytest.mark.parametrize("loss,beta", LOSSES)
def test_cp4_long_prompts_each_loss_type(grpo, loss, beta):
    """cp 4, each row sharded over 4 ranks: loss, grad norm, rewards, KL, entropy, clip ratios,
    completion lengths, num_tokens every step, and the weight update == one process."""
    name = f"{loss}-{beta}"
    assert_same_grpo(grpo[name], grpo[f"one-{name}"])
    if beta:
        assert grpo[name]["logs"][1]["kl"] > 0
    assert any(log.get("clip_ratio/region_mean", 0) > 0 for log in grpo[name]["logs"])
    for rank in (1, 2, 3):
        assert grpo[f"{name}@{rank}"]["logs"] == grpo[name]["logs"]


@pytest.mark.numerics
@pytest.mark.timeout(660)
def test_dp2_cp2_advantages_over_dp(grpo):
    """dp 2 x cp 2 == one process with twice the micro-batch (groups normalised over DP)."""
    assert_same_grpo(grpo["dp2"], grpo["one-dp2"])
    for rank in (1, 2, 3):
        assert grpo[f"dp2@{rank}"]["logs"] == grpo["dp2"]["logs"]


@pytest.mark.numerics
@pytest.mark.timeout(660)
def test_dp2_cp2_real_greedy_generation(grpo):
    """Real (greedy) generation on the ring trainer: the same completions and rewards as one process."""
    assert_same_grpo(grpo["generate"], grpo["one-generate"], weights=False)


@pytest.mark.timeout(660)
def test_rollout_func_refused(grpo):
    """What runs per process is refused at construction, in one line, on every rank."""
    for rank in range(4):
        err = grpo["refused" if rank == 0 else f"refused@{rank}"].get("error", "")
        assert "rollout_func" in err and "\n" not in err, err
