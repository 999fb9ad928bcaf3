"""Runs of ``transformers.Trainer`` / TRL's ``SFTTrainer``, with and without ``RingTrainerMixin``,
for the tests of tests/train/test_hf_trainer.py (module level: run_distributed imports it).

A run is a dict (:func:`spec`); :func:`run` builds the tiny LLaMA, the data and the trainer it
describes, trains / evaluates / predicts and returns what the tests compare: the logged losses,
grad norms and epochs, the step counts, the weights before and after and the first step's
gradients (rank 0), eval loss, predictions. The model is a 2-layer LLaMA (hidden 32, GQA 4:2;
``model_kw`` changes its config) over the shipped demo tokenizer (VOCAB = 1658 tokens), fp32,
seeded: every run of the same seed starts from the same weights.

Runs that belong together share one spawn (:func:`phased_worker`): each process first runs its
one-process references with the default process group torn down (``WORLD_SIZE=1``), then the
ranks join a fresh gloo group and run the distributed runs; accelerate's shared state is reset
between trainers.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SEED = 0
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 32, 2, 4, 2, 64
EPS32 = torch.finfo(torch.float32).eps
VOCAB = 1658  # the demo tokenizer
TOKENS_PER_STEP = 4 * 64  # at most: 4 rows (dp2 x micro batch 2) of at most 64 tokens
STEPS = 4
# The tolerances of tests/train/test_hf_trainer.py (derived in its docstring).
LOSS_RTOL = (TOKENS_PER_STEP + VOCAB) * EPS32
UPDATE_RTOL = STEPS * LOSS_RTOL
# The longest chain of fp32 sums behind one logit, in the largest model and row here (NEW_USER_SFT:
# hidden 64, intermediate 128, a padding-free row of 2 x 96 tokens): per layer q/k/v (hidden), the
# attention (<= 192 keys), o_proj (hidden), gate/up (hidden), down (intermediate); then lm_head.
PATH = 2 * (64 + 192 + 64 + 64 + 128) + 64
GRAD_RTOL = (2 * PATH + VOCAB + TOKENS_PER_STEP) * EPS32
# TRL's SFTConfig as a new user writes it (SFTTrainer docs, packing): a tiny eager-attention LLaMA,
# 40 pre-tokenized documents of 6-40 tokens over the whole vocabulary (pad / bos / eos ids included),
# packed into rows of 96, a constant learning rate. fp32 here; NEW_USER_SFT_TRL_DEFAULTS keeps TRL's
# defaults for precision and checkpointing too (bf16 autocast, also on CPU; gradient checkpointing).
NEW_USER_SFT = dict(
    kind="sft",
    model_kw=dict(hidden_size=64, intermediate_size=128, attn_implementation="eager"),
    rows=40,
    doc_len=(6, 40),
    full_vocab=True,
    args=dict(
        max_length=96, learning_rate=2e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0
    ),
)
NEW_USER_SFT_TRL_DEFAULTS = {
    **NEW_USER_SFT,
    "args": {**NEW_USER_SFT["args"], "bf16": None, "activation_checkpointing": None},
}
TIMEOUT = 240.0
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


def spec(out: str, **kw: Any) -> dict[str, Any]:
    """A run: ``kind`` trainer | sft | fsdp (tests/train/hf_fsdp.py) | script (recipes/trl_sft/sft.py
    with ``argv``, in this process), ``mixin`` (RingTrainerMixin on/off), ``cp``, ``ulysses``
    (ulysses_size: cp = ulysses x ring), ``steps`` (max_steps; 0: one epoch), ``mb``, ``ga``, ``gc``
    (activation checkpointing), ``attn`` (the mixin's attention_checkpoint), ``lora``, ``avg``
    (average_tokens_across_devices), ``save`` (save_steps), ``resume`` (a checkpoint folder),
    ``evaluate``, ``predict``, ``collate`` (right | left padding), ``rows`` (training examples),
    ``moe`` (a tiny Qwen3-MoE with its router load-balancing loss on instead of the LLaMA), ``model_kw``
    (LlamaConfig overrides), ``args`` (TrainingArguments / SFTConfig overrides; None: the class's
    default), ``doc_len`` (the SFT documents' shortest and longest length), ``full_vocab`` (SFT
    document ids over the whole vocabulary instead of 3..299)."""
    base = dict(
        kind="trainer",
        mixin=False,
        cp=1,
        ulysses=1,
        steps=4,
        mb=2,
        ga=1,
        gc=False,
        attn="recompute",
        lora=False,
        avg=True,
        save=None,
        resume=None,
        evaluate=False,
        predict=False,
        collate="right",
        rows=48,
        moe=False,
        model_kw={},
        args={},
        doc_len=(5, 30),
        full_vocab=False,
        argv=None,
        out=out,
    )
    unknown = set(kw) - set(base)
    assert not unknown, unknown
    return {**base, **kw}


def tokenizer():
    from ringft.data.tokenizer import load_tokenizer

    tok = load_tokenizer("demo")
    tok.padding_side = "right"
    return tok


def tiny_moe(tok, moe_intermediate_size: int = 16) -> torch.nn.Module:
    """A 2-layer Qwen3-MoE (4 experts of width ``moe_intermediate_size``, 2 per token) of the tiny
    shape, ``output_router_logits`` on with ``router_aux_loss_coef`` 0.5 (the term is ~10 % of the
    loss), eager experts, fp32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=256,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


def tiny_model(tok, lora: bool, **overrides: Any) -> torch.nn.Module:
    """The tiny LLaMA (``overrides``: LlamaConfig keywords), peft LoRA on q/v if ``lora``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = dict(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(LlamaConfig(**{**config, **overrides}))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def examples(
    n: int, seed: int, low: int, high: int, prompts: bool, vocab: int | None = None
) -> list[dict[str, list[int]]]:
    """``n`` random-token examples of ``low..high`` tokens (ids 3..299: no specials; with ``vocab``,
    0..vocab-1); ``prompts``: labels mask a random prefix (-100)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        ids = torch.randint(*((0, vocab) if vocab else (3, 300)), (length,), generator=gen).tolist()
        row = {"input_ids": ids}
        if prompts:
            k = int(torch.randint(0, length // 2, (1,), generator=gen))
            row["labels"] = [-100] * k + ids[k:]
        out.append(row)
    return out


def _left_padding(tok):
    from transformers import DataCollatorForSeq2Seq

    tok.padding_side = "left"
    return DataCollatorForSeq2Seq(tok)


def _trainer(s: dict[str, Any], tok, model) -> Any:
    import datasets
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    from ringft.train.hf import RingTrainerMixin

    common = dict(
        output_dir=s["out"],
        per_device_train_batch_size=s["mb"],
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=s["ga"],
        max_steps=s["steps"] or -1,
        num_train_epochs=1,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="steps" if s["save"] else "no",
        save_steps=s["save"] or 500,
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=SEED,
        activation_checkpointing=s["gc"],
        average_tokens_across_devices=s["avg"],
        include_num_input_tokens_seen="non_padding",
    )
    kwargs = dict(cp_size=s["cp"], ulysses_size=s["ulysses"], attn_backend="torch") if s["mixin"] else {}
    if s["mixin"]:
        kwargs["attention_checkpoint"] = s["attn"]
    evals = datasets.Dataset.from_list(examples(7, 99, 10, 40, prompts=True))
    if s["kind"] == "sft":
        from trl import SFTConfig, SFTTrainer

        base = SFTTrainer
        sft = dict(packing=True, max_length=64, eval_packing=False, bf16=False)
        args = SFTConfig(**_given({**common, **sft, **s["args"]}))
        vocab = len(tok) if s["full_vocab"] else None
        train = datasets.Dataset.from_list(examples(s["rows"], 7, *s["doc_len"], prompts=False, vocab=vocab))
        data = dict(train_dataset=train, eval_dataset=evals.remove_columns("labels"), processing_class=tok)
    else:
        base = Trainer
        args = TrainingArguments(**_given({**common, **s["args"]}))
        train = datasets.Dataset.from_list(examples(s["rows"], 1234, 20, 64, prompts=True))
        collate = _left_padding(tok) if s["collate"] == "left" else DataCollatorForSeq2Seq(tok)
        data = dict(train_dataset=train, eval_dataset=evals, data_collator=collate, processing_class=tok)
    cls = type("RingTrainer", (RingTrainerMixin, base), {}) if s["mixin"] else base
    return cls(model=model, args=args, **data, **kwargs)


def _given(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the None values (the arguments class's defaults apply)."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _first_step_gradients(store: dict[str, Any]) -> Any:
    """A TrainerCallback that copies the trainable parameters' gradients into ``store`` (numpy, by
    name as :func:`_weights`) just before the first optimizer step: reduced over the ranks and
    clipped, what the optimizer sees."""
    from transformers import TrainerCallback

    from ringft.model.unwrap import pretrained_model

    class FirstStepGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 0 and not store:
                for name, p in pretrained_model(model).named_parameters():
                    if p.requires_grad and p.grad is not None:
                        store[name] = p.grad.detach().float().cpu().numpy().copy()

    return FirstStepGradients()


def _weights(model) -> dict[str, Any]:
    """The trainable parameters as numpy arrays (torch tensors would travel through shared memory
    that is gone when the process exits)."""
    from ringft.model.unwrap import pretrained_model

    return {
        k: v.detach().cpu().numpy().copy()
        for k, v in pretrained_model(model).named_parameters()
        if v.requires_grad
    }


def _script(argv: list[str]) -> dict[str, Any]:
    """recipes/trl_sft/sft.py ``main(argv)`` in this process; its logged losses and grad norms."""
    import importlib.util
    import json

    path = Path(__file__).resolve().parents[2] / "recipes" / "trl_sft" / "sft.py"
    spec_ = importlib.util.spec_from_file_location("trl_sft_recipe", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    module.main(argv)
    out = Path(argv[argv.index("--output_dir") + 1])
    logs = [h for h in json.loads((out / "log_history.json").read_text()) if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


def run(s: dict[str, Any]) -> dict[str, Any]:
    """Build, train (``steps``), evaluate / predict as ``s`` says; see the module docstring."""
    if s["kind"] == "script":
        return _script(s["argv"])
    if s["kind"] == "fsdp":
        from tests.train.hf_fsdp import fsdp_steps

        return fsdp_steps()
    tok = tokenizer()
    model = tiny_moe(tok) if s["moe"] else tiny_model(tok, s["lora"], **s["model_kw"])
    trainer = _trainer(s, tok, model)
    grads: dict[str, Any] = {}
    trainer.add_callback(_first_step_gradients(grads))
    initial = _weights(trainer.model)
    out: dict[str, Any] = {"bf16": bool(trainer.args.bf16)}
    if s["steps"] is not None:
        result = trainer.train(resume_from_checkpoint=s["resume"])
        logs = [h for h in trainer.state.log_history if "loss" in h]
        out.update(
            losses=[h["loss"] for h in logs],
            grad_norms=[h["grad_norm"] for h in logs],
            epochs=[h["epoch"] for h in logs],
            max_steps=trainer.state.max_steps,
            global_step=result.global_step,
            tokens_seen=trainer.state.num_input_tokens_seen,
            total_batch=trainer.get_total_train_batch_size(trainer.args),
            num_tokens=[h.get("num_tokens") for h in logs],
        )
    if s["evaluate"]:
        out["eval_loss"] = trainer.evaluate()["eval_loss"]
    if s["predict"]:
        pred = trainer.predict(trainer.eval_dataset)
        out.update(
            predictions=pred.predictions, label_ids=pred.label_ids, test_loss=pred.metrics["test_loss"]
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out.update(initial=initial, final=_weights(trainer.model), grads=grads)
    return out


def assert_updates_close(final: dict, reference: dict, initial: dict, rtol: float) -> None:
    """Per tensor, ``||(final - initial) - (reference - initial)|| <= rtol ||reference - initial||``
    (numpy or torch values); the reference must have moved (a tensor it did not move must not move)."""
    moved_any = False
    for name, ref in reference.items():
        ref = torch.as_tensor(ref).double()
        start = torch.as_tensor(initial[name]).double()
        got = torch.as_tensor(final[name]).double()
        moved, diff = (ref - start).norm().item(), (got - ref).norm().item()
        moved_any |= moved > 0
        assert diff <= rtol * moved, (
            f"update of {name} differs by {diff / moved if moved else diff:.3e} (rtol {rtol:.1e})"
        )
    assert sorted(final) == sorted(reference) and moved_any, "the reference run did not change any weight"


def assert_gradients_close(got: dict, reference: dict, rtol: float) -> None:
    """Per tensor, ``max |got - reference| <= rtol max |reference|`` (numpy or torch values, the
    same names); the reference must have a nonzero gradient somewhere."""
    assert sorted(got) == sorted(reference) and reference, (sorted(got), sorted(reference))
    for name, ref in reference.items():
        ref, diff = (
            torch.as_tensor(ref).double(),
            (torch.as_tensor(got[name]).double() - torch.as_tensor(ref).double()),
        )
        scale, err = ref.abs().max().item(), diff.abs().max().item()
        assert err <= rtol * scale, (
            f"gradient of {name} differs by {err / scale if scale else err:.3e} (rtol {rtol:.1e})"
        )
    assert any(torch.as_tensor(r).abs().max() > 0 for r in reference.values()), (
        "the reference has no gradient"
    )


def zero3_argv(model_dir: str, out: str) -> list[str]:
    """recipes/trl_sft/sft.py arguments of the ZeRO-3 test (tests/train/test_hf_launch.py): full
    fine-tuning of the tiny model on made-up chats, 2 packed rows of 128 tokens per step."""
    return [  # TRL's own flags (sft.py is a TrlParser script)
        *("--model_name_or_path", model_dir, "--dataset_name", "synthetic-chat:96", "--packing", "true"),
        *("--max_length", "128", "--per_device_train_batch_size", "2", "--max_steps", "4"),
        *("--learning_rate", "1e-3", "--lr_scheduler_type", "cosine", "--warmup_steps", "0.03"),
        *("--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "true"),
        *("--bf16", "false", "--activation_checkpointing", "false", "--num_train_epochs", "1"),
        *("--disable_tqdm", "true", "--output_dir", out),
    ]


def tiny_model_dir(path: Path) -> Path:
    """The tiny model (seeded) with the demo tokenizer and a plain chat template, saved."""
    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tiny_model(tok, lora=False).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def guarded(s: dict[str, Any]) -> dict[str, Any]:
    """:func:`run`, returning ``{"error": first line}`` instead of raising a ``ValueError``; with the
    run's wall time (``seconds``)."""
    start = time.perf_counter()
    try:
        out = run(s)
    except ValueError as exc:
        out = {"error": str(exc).splitlines()[0]}
    out["seconds"] = time.perf_counter() - start
    return out


def phased_worker(
    rank: int, world: int, alone: list[list[dict]], together: list[dict], store: str
) -> dict[str, list[dict]]:
    """Rank ``r`` runs ``alone[r]`` as one-process runs (no process group), then every rank runs
    ``together`` in a fresh ``world``-rank gloo group. Returns both lists of results."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    saved = {k: os.environ[k] for k in _DIST_ENV if k in os.environ}
    mine = alone[rank] if rank < len(alone) else []
    results: dict[str, list[dict]] = {"alone": [], "together": []}
    if any(alone):  # every rank leaves the launch's group (the same decision everywhere)
        dist.destroy_process_group()
        for key in saved:
            del os.environ[key]
        os.environ["WORLD_SIZE"] = "1"
        for s in mine:
            _reset_accelerate()
            results["alone"].append(guarded(s))
        os.environ.update(saved)
    if not together:
        return results
    if not dist.is_initialized():
        Path(store).mkdir(parents=True, exist_ok=True)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}/pg",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=TIMEOUT),
        )
    for s in together:
        _reset_accelerate()
        results["together"].append(guarded(s))
    return results
