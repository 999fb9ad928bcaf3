"""What RingTrainerMixin refuses before it trains (no processes: the checks read settings only):
untested transformers / trl versions, accelerate's own context parallelism, options that would
need full logits or shard over every process, FSDP that accelerate silently drops on CPU."""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest

from ringft.train.hf.checks import check_no_accelerate_cp, check_trainer_options
from ringft.train.hf.versions import SUPPORTED, check_versions, install_command


def test_installed_versions_are_supported():
    """The CI venv (setup.cfg's dev extra) installs versions inside the supported ranges."""
    check_versions(uses_trl=True)


@pytest.mark.parametrize(
    "package, version", [("transformers", "5.25.0"), ("transformers", "5.23.1"), ("trl", "1.17.0")]
)
def test_unsupported_version_is_refused(monkeypatch, package, version):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: version if p == package else real(p))
    low, high = SUPPORTED[package]
    with pytest.raises(
        RuntimeError, match=rf"tested with {package}>={low},<{high} but {version} is installed"
    ):
        check_versions(uses_trl=True)


def test_pip_install_resolves_the_supported_set():
    """setup.cfg's install_requires pins exactly the supported ranges, and the refusal's command
    installs both packages inside them."""
    import configparser
    from pathlib import Path

    from packaging.requirements import Requirement

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    lines = [line for line in setup["options"]["install_requires"].split("\n") if line and line[0] != "#"]
    needed = {r.name: r.specifier for r in map(Requirement, lines)}
    for package, (low, high) in SUPPORTED.items():
        assert str(needed[package]) in (f">={low},<{high}", f"<{high},>={low}"), package
        assert f"'{package}>={low},<{high}'" in install_command()
    assert install_command().startswith("pip install ")
    # every Python that python_requires admits can install the pinned releases (their Requires-Python,
    # read from the installed ones): else pip fails on "no matching distribution for transformers"
    from packaging.specifiers import SpecifierSet

    ours = SpecifierSet(setup["options"]["python_requires"])
    for package in SUPPORTED:
        theirs = SpecifierSet(importlib.metadata.metadata(package)["Requires-Python"] or "")
        for minor in range(8, 20):
            if f"3.{minor}" in ours:
                assert f"3.{minor}" in theirs, (package, f"3.{minor}", str(theirs))


def test_trl_version_is_checked_only_for_trl_trainers(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "0.1" if p == "trl" else real(p))
    check_versions(uses_trl=False)


@pytest.mark.parametrize("field", ["cp_size", "sp_size"])
def test_accelerate_context_parallelism_is_refused(field):
    args = SimpleNamespace(parallelism_config=SimpleNamespace(**{"cp_size": 1, "sp_size": 1, field: 2}))
    with pytest.raises(ValueError, match=rf"parallelism_config has {field}=2; ringft's cp_size replaces"):
        check_no_accelerate_cp(args)
    check_no_accelerate_cp(
        SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=1, sp_size=1, tp_size=2))
    )


def _trainer(**args) -> SimpleNamespace:
    base = dict(fsdp="", n_gpu=1, label_smoothing_factor=0.0, include_for_metrics=[], accelerator_config=None)
    return SimpleNamespace(
        args=SimpleNamespace(**{**base, **args}),
        accelerator=SimpleNamespace(parallelism_config=None, num_processes=1),
        compute_loss_func=None,
        is_fsdp_enabled=False,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ({"label_smoothing_factor": 0.1}, "need the full logits"),
        ({"loss_type": "dft"}, "loss_type='dft'"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"torch_compile": True}, "torch_compile"),
        ({"n_gpu": 2}, "one process per GPU"),
        ({"include_for_metrics": ["inputs"]}, "include_for_metrics='inputs'"),
        ({"train_sampling_strategy": "batch_rebalance"}, "batch_rebalance"),
        ({"fsdp": "full_shard"}, "accelerate runs FSDP only on accelerators"),
    ],
)
def test_options_that_cannot_run_exactly_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        check_trainer_options(_trainer(**args))
    check_trainer_options(_trainer())


@pytest.mark.parametrize(
    "cp, ulysses, message",
    [
        (4, 3, r"ulysses_size=3 does not divide cp_size=4 \(cp_size = ulysses_size x ring_size\): use one"),
        (3, 3, r"query heads \(4\) are not divisible by ulysses_size=3: use a ulysses_size dividing"),
        (2, 0, r"ulysses_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_ulysses_size_is_refused_before_the_trainer_is_built(cp, ulysses, message):
    """ulysses_size must split the CP group and the model's query heads: one line naming the sizes
    that work (ringft.ops' own problems), before the base trainer or any process group is touched."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from ringft import RingTrainerMixin

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    trainer = type("RingTrainer", (RingTrainerMixin, Trainer), {})
    with pytest.raises(ValueError, match=rf"^ringft.RingTrainerMixin: {message}"):
        trainer(model=LlamaForCausalLM(config), cp_size=cp, ulysses_size=ulysses)


def test_bad_attention_tile_tokens_is_refused_before_the_trainer_is_built():
    from transformers import Trainer

    from ringft import RingTrainerMixin

    trainer = type("RingTrainer", (RingTrainerMixin, Trainer), {})
    message = r"^ringft.RingTrainerMixin: attention_tile_tokens must be an integer >= 1 or null, got 0"
    with pytest.raises(ValueError, match=message):
        trainer(model=None, cp_size=2, attention_tile_tokens=0)


def test_attention_checkpoint_is_refused_without_activation_checkpointing(tmp_path):
    """save / offload keep what checkpointing would recompute: refused before the base trainer is
    built when the TrainingArguments do not checkpoint; a bad value names the choices."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from ringft import RingTrainerMixin

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    trainer = type("RingTrainer", (RingTrainerMixin, Trainer), {})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"attention_checkpoint='save' .* set activation_checkpointing=True"):
        trainer(model=LlamaForCausalLM(config), args=args, attention_checkpoint="save")
    with pytest.raises(ValueError, match=r"attention_checkpoint must be one of recompute, save, offload"):
        trainer(model=LlamaForCausalLM(config), args=args, attention_checkpoint=True)


def test_flos_estimate_is_the_base_trainers():
    """The mixin counts the parameters once; its estimate is transformers.Trainer's (no processes:
    both methods read ``self.model`` only)."""
    import torch
    from transformers import Trainer

    from ringft.train.hf.mixin import RingTrainerMixin
    from tests.tiny_models import tiny_model

    fake = SimpleNamespace(model=tiny_model("llama"), _ring=object(), _flos_parameters=None)
    for inputs in ({"input_ids": torch.zeros(2, 48, dtype=torch.long)}, {"input_ids": torch.zeros(1, 8)}, {}):
        mine = RingTrainerMixin.floating_point_ops(fake, inputs)
        assert mine == Trainer.floating_point_ops(fake, inputs)
    assert fake._flos_parameters == fake.model.num_parameters(exclude_embeddings=True) > 0


def test_one_process_ddp_reduces_once_per_optimizer_step(tmp_path):
    """accelerate wraps a lone CPU process in DDP, but its ``no_sync`` needs several processes: the
    mixin's micro-step skips DDP's reduction until the step's last micro-step (the own loop's
    order; the sums are the same, world 1)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ringft.train.hf.mixin import RingTrainerMixin

    class Base:
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = model(inputs).sum()
            loss.backward()
            return loss.detach()

    class Trainer(RingTrainerMixin, Base):
        pass

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
        reduced: list[bool] = []
        trainer = object.__new__(Trainer)  # the override reads these attributes only
        trainer._ring = object()
        trainer.accelerator = SimpleNamespace(use_distributed=False, sync_gradients=False)

        def count(state, bucket):
            reduced.append(trainer.accelerator.sync_gradients)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, count)
        for last in (False, True, False, True):  # two optimizer steps of two micro-steps
            trainer.accelerator.sync_gradients = last
            trainer.training_step(ddp, torch.ones(3, 4))
        assert reduced == [True, True]
    finally:
        dist.destroy_process_group()
