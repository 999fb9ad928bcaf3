"""The shipped recipes, accelerate launch configs and shell wrappers under recipes/.

Fast and local: no GPU, no model download, no packed data (a recipe's data.path is pointed at an
empty temporary folder, the only thing recipe validation looks at on disk).
"""

from __future__ import annotations

import configparser
import fnmatch
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.recipes.shell_stubs import check_command, run_script, scratch_root

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # allow running without the package installed
    sys.path.insert(0, str(REPO_ROOT))

from ringft.train.recipe import RecipeError, apply_overrides, load_recipe, recipe_from_dict, validate  # noqa: E402

RECIPES = REPO_ROOT / "recipes"
ACCEL = RECIPES / "accelerate"

RECIPE_FILES = sorted(p for p in RECIPES.rglob("*.yaml") if ACCEL not in p.parents)
ACCEL_FILES = sorted(ACCEL.glob("*.yaml"))
WRAPPERS = [
    "llama3_8b_512k/run.sh",
    "llama3_8b_512k/run_lora.sh",
    "mistral_7b_512k/run.sh",
]
SHELL_FILES = sorted(p for p in RECIPES.rglob("*.sh"))

FULL_FT = ["deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml", "fsdp.yaml"]
# recipe (glob relative to recipes/) -> the launch configs it is meant to run under. Every recipe
# must match exactly one entry, so a new recipe has to say how it is launched.
LAUNCH = [
    ("demo_cpu.yaml", ["cpu_2proc.yaml"]),
    ("demo/base_induction.yaml", []),  # one process, no launcher (stage 0a of the demo base model)
    ("demo/base.yaml", []),  # one process, no launcher: `python -m ringft train recipes/demo/base.yaml`
    ("demo/extend.yaml", ["cpu_2proc.yaml"]),
    ("llama3_8b_512k/stage?_*k.yaml", FULL_FT),
    ("mistral_7b_512k/stage?_*k.yaml", FULL_FT),
    ("llama3_8b_512k/stage4_512k_lora.yaml", ["1node_8gpu.yaml", "2node_8gpu.yaml"]),
    ("smollm2_32k/stage?_*k.yaml", ["1node_8gpu.yaml"]),  # run.sh: --num_processes NUM_GPUS (default 1)
]
# Recipes that are scripts around RingTrainerMixin, not ringft YAML: the launch configs they use.
SCRIPT_LAUNCH = {"trl_sft/run.sh": ["fsdp2.yaml"], "trl_sft/run_cpu.sh": ["cpu_2proc.yaml"]}
# Recipes written for these wrappers (stricter checks than the demo's).
STAGE_NAMES = ("stage1_64k", "stage2_128k", "stage3_256k", "stage4_512k")
STAGED = {d: [f"{d}/{n}.yaml" for n in STAGE_NAMES] for d in ("llama3_8b_512k", "mistral_7b_512k")}
LORA = "llama3_8b_512k/stage4_512k_lora.yaml"
ONE_MILLION = 1 << 20  # the reference recipe's ~1M tokens per optimizer step


def rel(path: Path) -> str:
    return path.relative_to(RECIPES).as_posix()


def raw_recipe(name: str) -> dict:
    return yaml.safe_load((RECIPES / name).read_text())


def launch_configs(name: str) -> list[str]:
    hits = [configs for pattern, configs in LAUNCH if fnmatch.fnmatch(name, pattern)]
    assert len(hits) == 1, (
        f"{name} matches {len(hits)} LAUNCH entries (add it to tests/recipes/test_recipes.py)"
    )
    return hits[0]


def build(name: str, data_dir: Path, extra: list[str] | None = None):
    """The validated Recipe, with data.path (if any) pointed at an existing empty folder."""
    raw = raw_recipe(name)
    overrides = list(extra or [])
    if (raw.get("data") or {}).get("path") is not None:
        overrides += ["--data.path", str(data_dir)]
    return recipe_from_dict(apply_overrides(raw, overrides))


def num_processes(config: str) -> int:
    return int(yaml.safe_load((ACCEL / config).read_text())["num_processes"])


def tokens_per_step(recipe, world: int) -> int:
    dp = world // recipe.parallel.cp_size
    return dp * recipe.train.micro_batch_size * recipe.train.grad_accum * recipe.data.seq_len


# -- recipes ---------------------------------------------------------------------------------------


def test_recipes_found():
    """The recipes the tests below single out exist, each recipe file says how it is launched
    (exactly one LAUNCH entry), and no LAUNCH entry is left over from a removed recipe."""
    names = {rel(p) for p in RECIPE_FILES}
    for stages in STAGED.values():
        assert set(stages) <= names
    assert LORA in names and "demo_cpu.yaml" in names
    for name in names:
        launch_configs(name)  # exactly one entry
    stale = [pattern for pattern, _ in LAUNCH if not fnmatch.filter(names, pattern)]
    assert not stale, f"LAUNCH entries matching no recipe: {stale}"


@pytest.mark.parametrize("path", RECIPE_FILES, ids=rel)
def test_recipe_validates_and_fits_its_launch_configs(path, tmp_path):
    name = rel(path)
    recipe = build(name, tmp_path)
    cp = recipe.parallel.cp_size
    assert recipe.data.seq_len % (2 * cp) == 0, "zigzag sharding needs seq_len % (2 * cp_size) == 0"
    for config in launch_configs(name):
        world = num_processes(config)
        assert world % cp == 0, f"cp_size {cp} does not divide {config}'s {world} processes"
        validate(recipe, world_size=world)


@pytest.mark.parametrize("path", RECIPE_FILES, ids=rel)
def test_recipe_fails_only_for_missing_data(path):
    """Loaded as-is, a recipe is either valid or only lacks its packed dataset."""
    raw = yaml.safe_load(path.read_text())
    data_path = (raw.get("data") or {}).get("path")
    if data_path is None or Path(data_path).exists() or (REPO_ROOT / data_path).exists():
        load_recipe(path)
        return
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(path)


@pytest.mark.parametrize("model_dir", sorted(STAGED))
def test_stages_chain_and_grow(model_dir, tmp_path):
    stages = [build(n, tmp_path) for n in STAGED[model_dir]]
    assert not stages[0].model.name_or_path.startswith("outputs/"), "stage 1 starts from the hub model"
    for prev, nxt in zip(stages, stages[1:]):
        assert nxt.model.name_or_path == f"{prev.checkpoint.output_dir}/final"
        assert nxt.data.seq_len == 2 * prev.data.seq_len
        assert nxt.model.rope_theta > prev.model.rope_theta, "RoPE theta grows with the context"
    assert len({s.checkpoint.output_dir for s in stages}) == len(stages)
    data_paths = [raw_recipe(n)["data"]["path"] for n in STAGED[model_dir]]
    assert len(set(data_paths)) == len(stages)
    for s in stages:
        assert s.checkpoint.output_dir.startswith(f"outputs/{model_dir}/")
        assert s.model.max_position_embeddings == s.data.seq_len
        assert s.model.rope_scaling is None
    assert [s.data.seq_len for s in stages] == [65536, 131072, 262144, 524288]
    assert stages[-1].parallel.cp_size == 8


@pytest.mark.parametrize("name", [n for stages in STAGED.values() for n in stages] + [LORA])
def test_long_context_settings(name, tmp_path):
    r = build(name, tmp_path)
    t = r.train
    assert r.model.dtype == "bf16"
    assert t.gradient_checkpointing and t.chunked_loss and t.loss_chunk_size > 0
    assert t.schedule == "constant" and 0 < t.warmup_steps <= 0.1 * t.max_steps
    assert t.betas == (0.9, 0.95)
    if r.lora is None:  # the reference recipe's optimizer settings
        assert t.lr == pytest.approx(2e-5) and t.weight_decay == pytest.approx(0.1)
    # 64K tokens per rank and ~1M tokens per optimizer step on one node of 8 GPUs
    assert r.data.seq_len // r.parallel.cp_size == 65536
    assert tokens_per_step(r, 8) == ONE_MILLION
    assert f"{ONE_MILLION:,}" in (RECIPES / name).read_text(), "the header states the tokens per step"


def test_lora_recipe(tmp_path):
    r = build(LORA, tmp_path)
    stage3 = build(STAGED["llama3_8b_512k"][2], tmp_path)
    stage4 = build(STAGED["llama3_8b_512k"][3], tmp_path)
    assert r.lora is not None and r.lora.r > 0
    assert "lm_head" not in r.lora.target_modules, "the chunked loss cannot see an adapter on lm_head"
    assert r.model.name_or_path == f"{stage3.checkpoint.output_dir}/final"
    assert (r.data.path, r.data.seq_len, r.model.rope_theta) == (
        stage4.data.path,
        stage4.data.seq_len,
        stage4.model.rope_theta,
    )
    assert r.checkpoint.output_dir not in (stage3.checkpoint.output_dir, stage4.checkpoint.output_dir)
    # on two nodes (dp 2 x cp 8) the header's --train.grad_accum 1 keeps ~1M tokens per step
    assert tokens_per_step(build(LORA, tmp_path, ["--train.grad_accum", "1"]), 16) == ONE_MILLION


HYBRID = "--parallel.cp_size 16 --parallel.ulysses_size 8"  # the 2-node Ulysses x ring option


@pytest.mark.parametrize("name", [LORA, STAGED["llama3_8b_512k"][3], STAGED["mistral_7b_512k"][3]])
def test_two_node_hybrid_option(name, tmp_path):
    """The documented 2-node override (2node_8gpu.yaml, the LoRA recipe, recipes/README.md) loads for
    the config's 16 processes as one CP group of ulysses 8 (a node) x ring 2, 32K tokens per GPU
    and ~1M tokens per step; 8 divides both models' 32 query heads."""
    for doc in (ACCEL / "2node_8gpu.yaml", RECIPES / LORA, RECIPES / "README.md"):
        assert HYBRID in " ".join(doc.read_text().split()), doc
    r = build(name, tmp_path, HYBRID.split())
    validate(r, world_size=num_processes("2node_8gpu.yaml"))
    assert (r.parallel.cp_size, r.parallel.ulysses_size) == (16, 8)
    assert r.data.seq_len // r.parallel.cp_size == 32768
    assert tokens_per_step(r, 16) == ONE_MILLION


def test_lora_wrapper_prints_the_two_node_hybrid(tmp_path):
    """run_lora.sh with the 2-node config and the hybrid override: accelerate knows the launch, the
    recipe loads with the overrides."""
    root = _copy_recipes(tmp_path)
    out = _run_wrapper(
        root,
        "llama3_8b_512k/run_lora.sh",
        "--model.name_or_path",
        "meta-llama/Meta-Llama-3-8B",
        *HYBRID.split(),
        ACCELERATE_CONFIG="recipes/accelerate/2node_8gpu.yaml",
        LAUNCH_ARGS="--main_process_ip 10.0.0.1 --machine_rank 1",
    )
    assert out.returncode == 0, out.stderr
    assert "--config_file recipes/accelerate/2node_8gpu.yaml" in out.stdout and HYBRID in out.stdout
    _check_printed(out.stdout, tmp_path)


@pytest.mark.parametrize("name", STAGED["mistral_7b_512k"])
def test_mistral_disables_sliding_window(name):
    raw = raw_recipe(name)
    assert "sliding_window" in raw["model"] and raw["model"]["sliding_window"] is None


@pytest.mark.parametrize("name", [n for stages in STAGED.values() for n in stages] + [LORA])
def test_every_key_is_commented(name):
    """Each `key: value` line carries a comment saying why (section headers need none)."""
    bare = [
        line
        for line in (RECIPES / name).read_text().splitlines()
        if line.strip()
        and not line.lstrip().startswith("#")
        and not line.rstrip().endswith(":")
        and "#" not in line
    ]
    assert not bare, f"uncommented keys in {name}: {bare}"


def test_recipes_are_self_contained():
    """Nothing under recipes/ points outside the repository (a design file, this machine's paths)."""
    for path in sorted(RECIPES.rglob("*")):
        if path.is_file():
            text = path.read_text()
            for needle in ("/" + "work/", "../" + "shared", "DESIGN.md"):  # (built so this file names none)
                assert needle not in text, f"{rel(path)} refers to {needle!r}, which is not in the repository"


# -- accelerate launch configs --------------------------------------------------------------------

BASE_KEYS = {
    "compute_environment",
    "distributed_type",
    "num_machines",
    "num_processes",
    "machine_rank",
    "mixed_precision",
    "main_process_port",
    "rdzv_backend",
}
EXPECTED = {
    "cpu_2proc.yaml": {"distributed_type": "MULTI_GPU", "num_processes": 2, "use_cpu": True},
    "1node_8gpu.yaml": {
        "distributed_type": "MULTI_GPU",
        "num_processes": 8,
        "num_machines": 1,
        "mixed_precision": "bf16",
    },
    "2node_8gpu.yaml": {
        "distributed_type": "MULTI_GPU",
        "num_processes": 16,
        "num_machines": 2,
        "mixed_precision": "bf16",
    },
    "deepspeed_zero3.yaml": {"distributed_type": "DEEPSPEED", "num_processes": 8, "mixed_precision": "bf16"},
    "deepspeed_zero3_offload.yaml": {
        "distributed_type": "DEEPSPEED",
        "num_processes": 8,
        "mixed_precision": "bf16",
    },
    "fsdp.yaml": {"distributed_type": "FSDP", "num_processes": 8, "mixed_precision": "bf16"},
    "fsdp2.yaml": {"distributed_type": "FSDP", "num_processes": 8, "mixed_precision": "bf16"},
}


def launch_arg_names() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions}


def test_every_launch_config_is_known():
    """Each launch config is one EXPECTED describes (test_launch_config checks it against that) and
    the launch of some shipped recipe (LAUNCH); every launch config a file under recipes/ names
    exists and loads with accelerate's own loader."""
    from accelerate.commands.config.config_args import ClusterConfig

    assert {p.name for p in ACCEL_FILES} == set(EXPECTED)
    used = {config for _, configs in [*LAUNCH, *SCRIPT_LAUNCH.items()] for config in configs}
    for script, configs in SCRIPT_LAUNCH.items():
        assert all(f"recipes/accelerate/{c}" in (RECIPES / script).read_text() for c in configs), script
    assert used == set(EXPECTED), f"launched by no recipe: {sorted(set(EXPECTED) - used)}"
    named = {
        name
        for path in RECIPES.rglob("*")
        if path.is_file()
        for name in re.findall(r"recipes/accelerate/([\w.-]+\.yaml)", path.read_text())
    }
    assert named and named <= set(EXPECTED), f"named but not shipped: {sorted(named - set(EXPECTED))}"
    for name in sorted(named):
        ClusterConfig.from_yaml_file(str(ACCEL / name))


@pytest.mark.parametrize("path", ACCEL_FILES, ids=lambda p: p.name)
def test_launch_config(path):
    text = path.read_text()
    assert text.startswith("#"), "every launch config starts with a comment saying when to use it"
    cfg = yaml.safe_load(text)
    assert BASE_KEYS <= set(cfg), f"missing {BASE_KEYS - set(cfg)}"
    for key, value in EXPECTED[path.name].items():
        assert cfg[key] == value, f"{path.name}: {key} = {cfg[key]!r}, expected {value!r}"
    from accelerate.commands.config.config_args import ClusterConfig

    ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: unknown keys are errors
    # `accelerate launch` copies deepspeed_config / fsdp_config entries onto its arguments; a key
    # that is not one of them is silently ignored, so check the names.
    names = launch_arg_names()
    for key in cfg.get("deepspeed_config") or {}:
        assert key in names, f"{path.name}: deepspeed_config.{key} is not an accelerate launch option"
    for key in cfg.get("fsdp_config") or {}:
        assert (key if key.startswith("fsdp_") else "fsdp_" + key) in names, f"{path.name}: fsdp_config.{key}"


@pytest.mark.parametrize(
    "name,offload", [("deepspeed_zero3.yaml", "none"), ("deepspeed_zero3_offload.yaml", "cpu")]
)
def test_deepspeed_configs(name, offload):
    ds = yaml.safe_load((ACCEL / name).read_text())["deepspeed_config"]
    assert ds["zero_stage"] == 3 and ds["zero3_init_flag"] is True
    assert ds["offload_optimizer_device"] == offload and ds["offload_param_device"] == offload
    assert "deepspeed_config_file" not in ds  # would clash with the plugin fields above
    assert ds["gradient_clipping"] == 1.0 and ds["gradient_accumulation_steps"] == 1


def test_fsdp_config():
    fsdp = yaml.safe_load((ACCEL / "fsdp.yaml").read_text())["fsdp_config"]
    assert fsdp["fsdp_version"] == 1 and fsdp["fsdp_use_orig_params"] is True
    assert fsdp["fsdp_reshard_after_forward"] == "FULL_SHARD"
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert "fsdp_transformer_layer_cls_to_wrap" not in fsdp  # the model's _no_split_modules, any family
    assert fsdp["fsdp_activation_checkpointing"] is False  # the recipe's gradient_checkpointing does it


def test_fsdp2_config_as_accelerate_launch_reads_it(monkeypatch):
    """fsdp2.yaml through accelerate's own launch parsing and plugin: FSDP2, one unit per decoder
    layer, resharded after forward, sharded checkpoints, no FSDP activation checkpointing."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(ACCEL / "fsdp2.yaml"), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap is None  # the model's _no_split_modules
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading
    assert not plugin.activation_checkpointing  # the trainer's activation_checkpointing does it


def test_trl_sft_run_sh_launches_fsdp2_with_a_ring_of_8(tmp_path):
    """recipes/trl_sft/run.sh: the command it would run (DRY_RUN), as shipped."""
    env = dict(os.environ, DRY_RUN="1")
    out = subprocess.run(
        ["bash", str(RECIPES / "trl_sft" / "run.sh")], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[words.index("--config_file") + 1] == "recipes/accelerate/fsdp2.yaml"
    assert words[words.index("--cp_size") + 1] == "8" and "recipes/trl_sft/sft.py" in words
    for ref in (w for w in words if w.startswith("recipes/")):
        assert (REPO_ROOT / ref).is_file(), ref


@pytest.mark.parametrize("recipe", ["trl_dpo", "trl_grpo"])
def test_trl_dpo_and_grpo_run_sh_launch_zero3_with_a_ring_of_8(recipe):
    """recipes/trl_dpo/run.sh and recipes/trl_grpo/run.sh: the command each would run (DRY_RUN), as
    shipped: the shipped ZeRO-3 launch config, a ring of 8, the recipe's own script."""
    script = RECIPES / recipe / "run.sh"
    assert "run.sh" in script.name
    out = subprocess.run(
        ["bash", str(script)], env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[words.index("--config_file") + 1] == "recipes/accelerate/deepspeed_zero3.yaml"
    assert words[words.index("--cp_size") + 1] == "8"
    assert f"recipes/{recipe}/{recipe.split('_')[1]}.py" in words
    for ref in (w for w in words if w.startswith("recipes/")):
        assert (REPO_ROOT / ref).is_file(), ref


def test_two_node_config_has_placeholders():
    text = (ACCEL / "2node_8gpu.yaml").read_text()
    cfg = yaml.safe_load(text)
    assert cfg["main_process_ip"] == "MAIN_NODE_IP" and cfg["machine_rank"] == 0
    assert "--machine_rank 1" in text and "--machine_rank 0" in text


# -- shell wrappers --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrapper_is_an_executable_strict_script(name):
    path = RECIPES / name
    assert path.is_file()
    assert path.stat().st_mode & stat.S_IXUSR, f"{name} is not executable"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text and 'run_stages "$@"' in text
    for ref in [w for w in text.split() if w.startswith("recipes/") and w.endswith((".yaml", ".sh"))]:
        assert (REPO_ROOT / ref).is_file(), f"{name} refers to missing {ref}"


# Every shell script under recipes/ is run by a test: for real with python / accelerate / pip
# recorded, or in its DRY_RUN mode (tests/recipes/shell_stubs.py); the test checks each command it
# issues against the program it calls (the file exists, the called parser accepts the arguments).
SHELL_RUN_BY = {
    "_stages.sh": "test_recipes.py::test_wrapper_runs_stages_in_order",  # sourced by the wrappers
    "demo_cpu.sh": "test_demo.py::test_demo_script_evaluates_before_and_after_on_the_ring",
    "setup_cpu_env.sh": "test_recipes.py::test_cpu_setup_installs_the_pinned_torch_first",
    "llama3_8b_512k/run.sh": "test_recipes.py::test_wrapper_runs_stages_in_order",
    "llama3_8b_512k/run_lora.sh": "test_recipes.py::test_lora_wrapper_needs_stage3",
    "mistral_7b_512k/run.sh": "test_recipes.py::test_wrapper_runs_stages_in_order",
    "smollm2_32k/run.sh": "test_smollm2_recipe.py::test_wrappers_launch_the_stages_and_the_measurement",
    "smollm2_32k/measure.sh": "test_smollm2_recipe.py::test_wrappers_launch_the_stages_and_the_measurement",
    "smollm2_32k/prepare_data.sh": "test_smollm2_recipe.py::test_prepare_data_builds_what_the_stages_read",
    "trl_sft/run.sh": "test_recipes.py::test_trl_sft_run_sh_launches_fsdp2_with_a_ring_of_8",
    "trl_sft/run_cpu.sh": "../train/test_hf_launch.py::test_recipe_cpu_variant_matches_one_process",
    "trl_dpo/run.sh": "test_recipes.py::test_trl_dpo_and_grpo_run_sh_launch_zero3_with_a_ring_of_8",
    "trl_grpo/run.sh": "test_recipes.py::test_trl_dpo_and_grpo_run_sh_launch_zero3_with_a_ring_of_8",
    "trl_dpo/run_cpu.sh": "../train/test_trl_recipes.py::test_dpo_recipe_cpu_variant_matches_one_process",
    "trl_grpo/run_cpu.sh": "../train/test_trl_recipes.py::test_grpo_recipe_cpu_variant_matches_one_process",
}


def test_every_shell_script_runs_in_a_test():
    """Each script is run (not only parsed): listed in SHELL_RUN_BY with a test that names it."""
    assert set(SHELL_RUN_BY) == {rel(p) for p in SHELL_FILES}, "add the new script to SHELL_RUN_BY"
    here = Path(__file__).parent
    for script, test in SHELL_RUN_BY.items():
        module, name = test.split("::")
        source = (here / module).read_text()
        assert f"\ndef {name}(" in source, f"{script}: no test {test}"
        body = source.split(f"\ndef {name}(")[1].split("\ndef ")[0]
        runs = "run.sh" if script == "_stages.sh" else Path(script).name  # _stages.sh: through run.sh
        assert runs in body, f"{test} does not run {script}"


def test_cpu_setup_installs_the_pinned_torch_first(tmp_path):
    """setup_cpu_env.sh installs the CPU torch pin (one that setup.cfg's torch requirement admits)
    from PyTorch's CPU wheel index before the package, so pip never resolves a CUDA torch; ``base``
    installs ringft alone (the demo), ``dev`` adds the test extra; a second run with nothing changed
    installs nothing (the stamp records the extra: dev covers base); no argument is refused."""
    from packaging.requirements import Requirement

    root = scratch_root(tmp_path)

    def installs(extra):
        commands = run_script(root, "setup_cpu_env.sh", extra).commands
        return [c[c.index("install") + 1 :] for c in commands if "pip" in c]

    base = installs("base")
    assert len(base) == 3 and base[0] == ["-q", "--upgrade", "pip"]
    assert base[2] == ["-q", "-e", str(root)]
    torch_args = base[1]
    assert torch_args[torch_args.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert torch_args[torch_args.index("--retries") + 1] == "0"  # an unreachable index fails fast
    (pin,) = [Requirement(a) for a in torch_args if a.startswith("torch")]
    assert str(pin.specifier).startswith("==") and pin.name == "torch"
    setup = configparser.ConfigParser()
    setup.read(REPO_ROOT / "setup.cfg")
    needed = [Requirement(line) for line in setup["options"]["install_requires"].split("\n") if line]
    (wanted,) = [r for r in needed if r.name == "torch"]
    assert wanted.specifier.contains(str(pin.specifier)[2:])
    assert installs("base") == []
    assert installs("dev")[2] == ["-q", "-e", f"{root}[dev]"]
    assert installs("dev") == [] and installs("base") == []
    refused = run_script(root, "setup_cpu_env.sh")
    assert refused.returncode == 2 and "give 'base'" in refused.stderr and refused.commands == []
    old = tmp_path / "python3.10"  # a Python the pinned transformers / trl do not install on
    old.write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.10.12"\nexit 1\n')
    old.chmod(0o755)
    refused = run_script(root, "setup_cpu_env.sh", "base", PYTHON=str(old), RINGFT_VENV=str(tmp_path / "v"))
    assert refused.returncode == 2 and "Python 3.10.12" in refused.stderr and "3.11" in refused.stderr
    assert refused.commands == [] and not (tmp_path / "v").exists()


def _copy_recipes(tmp_path: Path) -> Path:
    """A scratch repo root holding recipes/ only (no outputs/ from real runs)."""
    shutil.copytree(RECIPES, tmp_path / "recipes")
    return tmp_path


def _run_wrapper(root: Path, name: str, *args: str, dry: bool = True, **env: str):
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STAGES", "DRY_RUN", "ACCELERATE_CONFIG", "LAUNCH_ARGS")
    }
    full_env.update(PYTHON=sys.executable, ACCELERATE="echo", **env)
    if dry:
        full_env["DRY_RUN"] = "1"
    return subprocess.run(
        ["bash", str(root / "recipes" / name), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _check_printed(line: str, tmp_path: Path, keep_overrides: bool = True) -> None:
    """A DRY_RUN line (``ACCELERATE=echo``) as the launch it prints: the config exists, accelerate
    knows every flag and the stage's recipe loads (with the test's own overrides, or without)."""
    command = ["accelerate", *shlex.split(line)[1:]]
    if not keep_overrides:
        command = command[: command.index("--resume") + 1]
    data = tmp_path / "packed-data"
    data.mkdir(exist_ok=True)
    assert check_command(command, data) == "ringft train"


@pytest.mark.parametrize(
    "model_dir,config",
    [("llama3_8b_512k", "deepspeed_zero3.yaml"), ("mistral_7b_512k", "deepspeed_zero3.yaml")],
)
def test_wrapper_runs_stages_in_order(model_dir, config, tmp_path):
    root = _copy_recipes(tmp_path)
    out = _run_wrapper(root, f"{model_dir}/run.sh", "--train.max_steps", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(STAGED[model_dir])
    for line, stage in zip(lines, STAGED[model_dir]):
        assert f"launch --config_file recipes/accelerate/{config} " in line
        assert line.rstrip().endswith(f"-m ringft train recipes/{stage} --resume --train.max_steps 3")
        _check_printed(line, tmp_path, keep_overrides=False)  # (max_steps 3 is below the warmup)


def test_wrapper_stage_selection_skip_and_fsdp(tmp_path):
    root = _copy_recipes(tmp_path)
    done = root / "outputs/mistral_7b_512k/stage2_128k/final"
    done.mkdir(parents=True)
    (done / "ringft_recipe.json").write_text("{}")
    out = _run_wrapper(
        root, "mistral_7b_512k/run.sh", STAGES="2 3", ACCELERATE_CONFIG="recipes/accelerate/fsdp.yaml"
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "recipes/mistral_7b_512k/stage3_256k.yaml" in lines[0]
    assert "--fsdp_transformer_layer_cls_to_wrap" not in lines[0]  # the config wraps any family
    _check_printed(lines[0], tmp_path)  # accelerate knows the FSDP flag, the stage loads
    assert "skipping" in out.stderr
    bad = _run_wrapper(root, "mistral_7b_512k/run.sh", STAGES="7")
    assert bad.returncode != 0 and "STAGES" in bad.stderr
    bad = _run_wrapper(root, "mistral_7b_512k/run.sh", STAGES="2", DRY_RUN="maybe", dry=False)
    assert bad.returncode == 2 and "DRY_RUN=maybe" in bad.stderr  # refused, though stage 2 is done


def test_lora_wrapper_needs_stage3(tmp_path):
    root = _copy_recipes(tmp_path)
    out = _run_wrapper(root, "llama3_8b_512k/run_lora.sh", dry=False)
    assert out.returncode == 1 and "stage3_256k/final" in out.stderr and "launch" not in out.stdout
    hub = ("--model.name_or_path", "meta-llama/Meta-Llama-3-8B")
    out = _run_wrapper(root, "llama3_8b_512k/run_lora.sh", *hub)
    assert out.returncode == 0, out.stderr
    assert "--config_file recipes/accelerate/1node_8gpu.yaml" in out.stdout
    assert out.stdout.rstrip().endswith("--resume --model.name_or_path meta-llama/Meta-Llama-3-8B")
    _check_printed(out.stdout, tmp_path)


def test_wrapper_reads_overrides_as_ringft_train_does(tmp_path):
    """The wrapper's pre-launch checks read ``--a.b=value`` and the last of repeated overrides, past
    ``ringft train``'s own flags, as ``ringft train`` does: a hub model and a data folder given that
    way are not refused."""
    root = _copy_recipes(tmp_path)
    data = tmp_path / "packed"
    data.mkdir()
    args = (
        "--no-progress",
        "--model.name_or_path",
        "outputs/none",
        "--model.name_or_path=meta-llama/Meta-Llama-3-8B",
    )
    out = _run_wrapper(root, "llama3_8b_512k/run_lora.sh", *args, f"--data.path={data}", dry=False)
    assert out.returncode == 0 and "does not exist" not in out.stderr, out.stderr
    assert out.stdout.startswith("launch --config_file recipes/accelerate/1node_8gpu.yaml")
    eval_path = ("--data.eval_path", str(tmp_path / "none"))  # an eval folder is checked as well
    out = _run_wrapper(
        root, "llama3_8b_512k/run_lora.sh", *args, f"--data.path={data}", *eval_path, dry=False
    )
    assert out.returncode == 1 and f"data.eval_path {tmp_path / 'none'}, which does not" in out.stderr
    # several stages with one output_dir (or start model): each would read the previous one's final
    out = _run_wrapper(root, "llama3_8b_512k/run.sh", "--checkpoint.output_dir=outputs/x", dry=False)
    assert out.returncode == 2 and "give it for one stage (STAGES=N)" in out.stderr and not out.stdout


def test_wrapper_checks_a_local_start_model(tmp_path):
    """A first stage that starts from a local folder (smollm2_32k: models/..., built by
    prepare_data.sh) is refused by name before launching when the folder is missing (else it is
    looked up on the hub after the launch)."""
    root = _copy_recipes(tmp_path)
    for k in ("16k", "32k"):
        (root / "data" / f"smollm2-mix-{k}").mkdir(parents=True)
    out = _run_wrapper(root, "smollm2_32k/run.sh", dry=False)
    assert out.returncode == 1 and not out.stdout
    assert "models/smollm2-135m-instruct, which does not exist: build it first" in out.stderr
    (root / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    ok = _run_wrapper(root, "smollm2_32k/run.sh", STAGES="1", dry=False)
    assert ok.returncode == 0 and "stage1_16k.yaml --resume" in ok.stdout, ok.stderr
