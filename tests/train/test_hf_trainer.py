"""``RingTrainerMixin`` in ``transformers.Trainer`` and TRL's ``SFTTrainer`` against the same
trainers without ringft, on gloo CPU processes (tiny fp32 LLaMA, tests/train/hf_runs.py).

Two spawns hold every run (tests/train/conftest.py; process start and the transformers / TRL
imports cost seconds):

- 2 processes: first each one runs one-process references on its own (no process group), then
  together: plain ``Trainer`` with dp=2 (DDP: the references of the 4-process runs) and the ring
  trainers with dp=1 x cp=2;
- 4 processes: the ring trainers with dp=2 x cp=2, with cp=4 = ulysses 2 x ring 2 (dp=1), and a
  ring of 4 (the packed SFT configuration of a new user).

Oracles: one-process ``Trainer`` / ``SFTTrainer`` (sdpa attention; transformers masks the packed
documents of TRL's padding-free batches from their restarting position_ids), or plain DDP with dp=2.

Tolerances (derived as in tests/train/test_trainer.py, issue 18): the runs compute the same fp32
math with the sums in another order (ring vs full attention, shards vs whole rows, chunked vs
whole logits). A step's loss is a mean over at most TOKENS_PER_STEP targets of a log-sum-exp over
VOCAB logits: LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * eps32 = 2.3e-4.

The first step's gradients (reduced over the ranks, clipped: what the optimizer sees) are the
strict measure, per tensor: both runs start from the same weights on the same batch, so only the
order of the fp32 sums differs. The backward retraces the longest chain of sums behind a logit
(PATH: q/k/v, the attention's keys, o_proj, gate/up, down per layer, then lm_head; the largest
model and row here), after the log-sum-exp over VOCAB, and a weight's gradient sums over the step's
tokens: GRAD_RTOL = (2 PATH + VOCAB + TOKENS_PER_STEP) eps32 = 4.9e-4 of the tensor's largest
entry (first-order bound of reordered sums; the measured differences are ~1e-6).

The weight update after STEPS AdamW steps is a coarser check (UPDATE_RTOL = STEPS * LOSS_RTOL),
valid in fp32 only. Adam's update of an element is lr g / (|g| + eps) (first step), whose
derivative eps / (|g| + eps)^2 reaches 1 / eps at g ~ 0: an absolute gradient error d moves the
update of the elements with |g| < d by up to its whole size (the sign flips). In fp32 d (~1e-10
here) stays below Adam's eps = 1e-8, so no element flips and UPDATE_RTOL holds; in bf16 d (~1e-6)
does not: a 0.7 % gradient difference flips ~0.3 % of the signs, and each flip changes a tensor's
update L2 by 2 / sqrt(its size) (one flip in a 64-entry norm weight: 25 %). Runs in bf16 are
therefore compared by their gradients only (test_sft_packing_new_user_config).

The bugs these tests exist for are far outside: a loss scaled by cp (2x), a denominator counted
per rank instead of per step (>= 1 / 128 = 8e-3), packed documents attending across their
boundaries (~1e-3 of the loss here, 1.5x the gradient), one target of the step's ~200 wrong or
dropped (~5e-3 of the gradient), a skipped or duplicated batch (whole per cents of the update).
Resuming replays the same operations: equal to the last bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.train.hf_runs import (
    EPS32,
    GRAD_RTOL,
    LOSS_RTOL,
    STEPS,
    assert_gradients_close,
    assert_updates_close,
    examples,
)

pytestmark = pytest.mark.filterwarnings("ignore")

BF16_UNIT = 2.0**-8  # bf16's unit round-off
BF16_MARGIN = 1.5  # the ring's bf16 gradient error over one process's (test_sft_packing_new_user_config)


def assert_same_training(got: dict, ref: dict, rtol: float = LOSS_RTOL) -> None:
    """Same logged loss and grad norm every step, same first-step gradients and weight update
    (relative, per tensor)."""
    assert "error" not in got and "error" not in ref, (got.get("error"), ref.get("error"))
    assert len(got["losses"]) == len(ref["losses"]) > 0
    assert_gradients_close(got["grads"], ref["grads"], GRAD_RTOL)
    assert got["losses"] == pytest.approx(ref["losses"], rel=rtol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=STEPS * rtol)
    assert_updates_close(got["final"], ref["final"], ref["initial"], STEPS * rtol)


# -- dp=1 x cp=2 against one process -------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_cp2_trainer_matches_one_process(hf_two):
    """Trainer(cp_size=2) on 2 ranks == Trainer on 1 process: loss, grad norm, update. Also the
    regression test of transformers #46775 (loss over-scaled by the SP size): a loss scaled by cp
    would be 2x here."""
    assert_same_training(hf_two["cp"], hf_two["one"])
    assert hf_two["cp@1"]["losses"] == hf_two["cp"]["losses"]  # every rank logs the step's loss


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_cp_size_1_is_the_base_trainer(hf_two):
    """cp_size=1 without memory options: the base class, bit for bit."""
    assert hf_two["inert"]["losses"] == hf_two["one"]["losses"]
    for name, value in hf_two["one"]["final"].items():
        assert np.array_equal(hf_two["inert"]["final"][name], value), name


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_grad_accum_and_activation_checkpointing(hf_two):
    """micro batch 1 x gradient accumulation 2 with activation checkpointing (and the ring's
    ``attention_checkpoint="save"``): the step's denominator counts both micro-steps on both ranks."""
    assert_same_training(hf_two["cp-ga"], hf_two["one-ga"])


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_lora(hf_two):
    """peft LoRA (q/v): the adapter trains as in one process; the frozen base does not move."""
    assert_same_training(hf_two["cp-lora"], hf_two["one-lora"])
    assert all("lora_" in k for k in hf_two["cp-lora"]["final"])


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_moe_router_loss_matches_one_process(hf_two):
    """A Qwen3-MoE with ``output_router_logits``: the logged loss (token loss + 0.5 x the router
    load-balancing loss over the attention mask's rows of the whole batch) and the update at cp=2
    == one process. Leaving the term out, counting it per rank or over the ring's padding moves
    the loss by whole per cents. ``evaluate()``'s loss includes the term too, as transformers' does."""
    assert_same_training(hf_two["cp-moe"], hf_two["one-moe"])
    assert hf_two["cp-moe"]["eval_loss"] == pytest.approx(hf_two["one-moe"]["eval_loss"], rel=LOSS_RTOL)


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_sft_packing_matches_one_process(hf_two):
    """SFTTrainer(packing=True) (bfd, padding-free: restarting position_ids, varlen keys) with cp=2
    == one process on the same packed batches, documents masked apart. Regression test of axolotl
    #3608 (packing inflated the loss 1.83x) and of TRL #6843 (packing refused with CP)."""
    assert_same_training(hf_two["cp-sft"], hf_two["one-sft"])
    assert hf_two["cp-sft"]["num_tokens"] == hf_two["one-sft"]["num_tokens"]  # TRL's token counter
    assert hf_two["cp-sft"]["eval_loss"] == pytest.approx(hf_two["one-sft"]["eval_loss"], rel=LOSS_RTOL)


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_sft_packing_new_user_config(hf_two, hf_four):
    """The packed SFTTrainer as a new user configures it (tests/train/hf_runs.py NEW_USER_SFT: eager
    attention, hidden 64, documents over the whole vocabulary, rows of 96, lr 2e-3 constant) with
    cp 2 and with a ring of 4 == one process, in fp32: loss, grad norm, first-step gradients, update.

    With TRL's own defaults (bf16=True: autocast also on CPU; gradient checkpointing) both runs
    compute in bf16 and their gradients differ by ~0.8 %, as much as the one-process trainer's
    eager and sdpa attentions differ from each other; their AdamW updates then differ by up to
    25 % per tensor (module docstring): bf16 round-off, not the ring. The measure there is each bf16
    gradient's L2 distance from the fp32 run's, per tensor and over the whole model. The ring's
    fused kernel keeps the scores and probabilities in fp32 where eager rounds them to bf16, so
    over the model the ring's distance is at most the one-process trainer's (measured 0.89-0.93 of
    it); per tensor the two draw different roundings (measured <= 1.13 of it, noisiest on the
    64-entry norm weights). Bounds: 1.1x over the model, BF16_MARGIN per tensor. A ring computing
    anything in a lower precision than one process, or different math, is outside."""
    one = exact = hf_two["one-sft-user"]
    for got in (hf_two["cp-sft-user"], hf_four["cp4-sft-user"]):
        assert not got["bf16"] and not one["bf16"]
        assert_same_training(got, one)
    ring, alone = hf_two["cp-sft-user-bf16"], hf_two["one-sft-user-bf16"]
    assert ring["bf16"] and alone["bf16"]  # TRL's default
    assert ring["losses"] == pytest.approx(alone["losses"], rel=BF16_UNIT)
    ring_err, alone_err = (
        {k: np.linalg.norm(run["grads"][k] - g) for k, g in exact["grads"].items()} for run in (ring, alone)
    )
    for name, want in exact["grads"].items():
        bound = BF16_MARGIN * alone_err[name] + GRAD_RTOL * np.linalg.norm(want)
        assert ring_err[name] <= bound, (name, ring_err[name], alone_err[name])
    total = [np.sqrt(sum(e**2 for e in err.values())) for err in (ring_err, alone_err)]
    assert total[0] <= 1.1 * total[1], total


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_resume_continues_the_loss_curve(hf_two):
    """resume_from_checkpoint at step 2 of a cp=2 run: steps 3-4 and the final weights equal the
    uninterrupted run's exactly (the log history of steps 1-2 comes from the checkpoint)."""
    whole, resumed = hf_two["cp"], hf_two["cp-resumed"]
    assert resumed["global_step"] == STEPS
    assert resumed["losses"] == whole["losses"]
    for name, value in whole["final"].items():
        assert np.array_equal(resumed["final"][name], value), name


# -- evaluation, prediction, step counts --------------------------------------------------------------


def _real_positions() -> np.ndarray:
    """(rows, longest) mask of the eval examples' real tokens (predict pads them with -100)."""
    lengths = [len(e["input_ids"]) for e in examples(7, 99, 10, 40, prompts=True)]
    return np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]


def assert_same_predictions(got: dict, ref: dict) -> None:
    """Logits equal at every real token (same fp32 math reordered: (seq + hidden + intermediate) eps
    of the largest logit; padded positions hold whatever attention over padding gives), labels equal."""
    assert got["predictions"].shape == ref["predictions"].shape
    real = _real_positions()
    diff = np.abs(got["predictions"] - ref["predictions"])[real].max()
    scale = np.abs(ref["predictions"][real]).max()
    assert diff <= (64 + 32 + 64) * EPS32 * scale, diff
    assert np.array_equal(got["label_ids"], ref["label_ids"])
    assert got["test_loss"] == pytest.approx(ref["test_loss"], rel=LOSS_RTOL)


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_evaluate_and_predict_match_one_process(hf_two):
    """evaluate(): the eval loss of one process (regression test of transformers #48167: eval loss cp
    times too large); predict(): logits gathered within CP and un-zigzagged, labels, loss."""
    cp, one = hf_two["cp"], hf_two["one"]
    assert cp["eval_loss"] == pytest.approx(one["eval_loss"], rel=LOSS_RTOL)
    assert hf_two["cp@1"]["eval_loss"] == cp["eval_loss"]
    assert_same_predictions(cp, one)


@pytest.mark.timeout(600)
def test_step_counts_follow_dp_not_world(hf_two, hf_four):
    """One epoch of 21 examples (micro batch 2): the steps, epochs, total batch size and tokens seen
    of cp=2 equal one process's and dp2 x cp2's equal dp2's. Regression test of axolotl #3444 (batch
    size and step counts multiplied by the CP size)."""
    for got, ref in (
        (hf_two["cp-epoch"], hf_two["one-epoch"]),
        (hf_four["dp-cp-epoch"], hf_two["ddp-epoch"]),
    ):
        for key in ("max_steps", "global_step", "epochs", "total_batch", "tokens_seen"):
            assert got[key] == ref[key], key
        assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    assert hf_two["one-epoch"]["max_steps"] == 11 and hf_two["ddp-epoch"]["max_steps"] == 6


@pytest.mark.timeout(600)
def test_left_padding_is_refused_on_every_rank(hf_two):
    """A left-padding attention mask: one clear error on both ranks (no hang), naming the fix."""
    for name in ("cp-left-padded", "cp-left-padded@1"):
        message = hf_two[name]["error"]
        assert "right padding" in message and "padding_side = 'right'" in message, message


# -- dp=2 x cp=2 against dp=2 ------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_dp2_cp2_matches_dp2(hf_two, hf_four):
    """4 ranks (dp2 x cp2) == DDP on 2 ranks: with average_tokens_across_devices on (the step's
    count over every rank) and off (each replica's own count, averaged over replicas); eval loss and
    predictions gathered across DP only."""
    assert_same_training(hf_four["dp-cp"], hf_two["ddp"])
    assert_same_training(hf_four["dp-cp-off"], hf_two["ddp-off"])
    assert hf_four["dp-cp-off"]["losses"] != pytest.approx(hf_four["dp-cp"]["losses"], rel=LOSS_RTOL)
    assert hf_four["dp-cp"]["eval_loss"] == pytest.approx(hf_two["ddp"]["eval_loss"], rel=LOSS_RTOL)
    assert_same_predictions(hf_four["dp-cp"], hf_two["ddp"])
    for rank in (1, 2, 3):
        assert hf_four[f"dp-cp@{rank}"]["losses"] == hf_four["dp-cp"]["losses"]


# -- cp 4 = ulysses 2 x ring 2 (issue 26 through the mixin) ---------------------------------------------


@pytest.mark.numerics
@pytest.mark.timeout(600)
def test_ulysses_x_ring_matches_one_process(hf_two, hf_four):
    """RingTrainer(cp_size=4, ulysses_size=2) on 4 ranks (heads 4 / K/V heads 2 split over the
    Ulysses pairs, the zigzag ring over 2) == one process: Trainer's loss, grad norm, update, eval
    loss and predict() logits (gathered with the Ulysses x ring layout); SFTTrainer(packing=True)
    with its packed documents masked apart. The same fp32 math reordered as the ring alone (the
    all-to-alls move values without arithmetic): the bounds above. A batch sharded zigzag but
    attended in the 2D layout (or logits put back in zigzag order) would be off by whole per cents."""
    uly, one = hf_four["ulysses"], hf_two["one"]
    assert_same_training(uly, one)
    assert uly["eval_loss"] == pytest.approx(one["eval_loss"], rel=LOSS_RTOL)
    assert_same_predictions(uly, one)
    assert_same_training(hf_four["ulysses-sft"], hf_two["one-sft"])
    assert hf_four["ulysses-sft"]["eval_loss"] == pytest.approx(hf_two["one-sft"]["eval_loss"], rel=LOSS_RTOL)
    for rank in (1, 2, 3):
        assert hf_four[f"ulysses@{rank}"]["losses"] == uly["losses"]
