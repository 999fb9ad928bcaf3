"""The documentation's Python examples run as written (issue 17, item 3; issue 23, item 6): every
fenced ``python`` (or ``py``) block of README.md and of docs/*.md is extracted and run, so no example
can drift from the code.

Discovery: each page is read line by line; a fence may be indented (inside a list item), and its
body is dedented by the fence's indent. A block that starts a process group (``init_process_group``)
or says it is launched (``accelerate launch``: a Trainer joins the launch's group itself) runs under
``torchrun`` on 2 CPU processes; any other block runs in one process. Both get
``RINGFT_EXAMPLE_DEVICE=cpu`` (the switch the examples honour: gloo, fp32), ``RINGFT_EXAMPLE_MODEL``
pointing at a tiny saved LLaMA with the shipped demo tokenizer, and a fresh working folder.

The own-loop example (docs/api.md) gets an epilogue that checks it against the oracle: one process, no ring,
the whole batch. Tolerance: the ring reorders fp32 sums (attention over <= 2 x 256 keys, the loss
over as many tokens and a vocabulary of 1658, hidden 32, intermediate 64): eps32 x their total
length, relative to the loss and to each gradient's largest entry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PYTHON_FENCES = ("python", "py")
RTOL = torch.finfo(torch.float32).eps * (2 * 256 + 2 * 256 + 1658 + 32 + 64)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^`\s]*)")


class Block(NamedTuple):
    """One fenced code block: its page (relative to the repository), first line and language."""

    page: str
    line: int
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown page (indented fences included, bodies dedented)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = len(m["indent"]), i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        assert i < len(lines), f"{path.name}:{start}: code fence never closed"
        blocks.append(Block(path.relative_to(REPO).as_posix(), start, m["lang"], "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in fenced_blocks(page) if b.lang in PYTHON_FENCES]

EPILOGUE = """
# --- test epilogue: the oracle is one process, no ring, the whole batch ---
total = loss.detach().clone()
dist.all_reduce(total)
reference = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
full = collate.global_batch(examples)
n = (full["shift_labels"] != -100).sum()
labels = full["shift_labels"]
expected = reference(input_ids=full["input_ids"], position_ids=full["position_ids"], labels=labels,
                     shift_labels=labels, num_items_in_batch=n).loss
expected.backward()
expected = expected.item()
rtol = float(os.environ["RINGFT_EXAMPLE_RTOL"])
assert abs(total.item() - expected) <= rtol * abs(expected), (total.item(), expected)
for (key, p), q in zip(model.named_parameters(), reference.parameters()):
    err = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
    assert err <= rtol, (key, err)
print(f"rank {rank}: the own-loop example matches one process", flush=True)
"""


def _is_distributed(block: Block) -> bool:
    return "init_process_group" in block.code or "accelerate launch" in block.code


def _is_own_loop(block: Block) -> bool:
    code = block.code
    return block.page == "docs/api.md" and "apply_ring_attention" in code and "loss_normalization" in code


# An orderly end of a torchrun example: the process group destroyed before the interpreter exits
# (otherwise gloo's threads can still be joinable at exit, and the C++ runtime aborts the finished
# process now and then with "terminate called without an active exception").
TEARDOWN = """
import torch.distributed as _dist

if _dist.is_initialized():
    _dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("demo")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    path = tmp_path_factory.mktemp("readme") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def test_readme_has_the_own_loop_example():
    assert sum(_is_own_loop(b) for b in BLOCKS) == 1
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/api.md", "docs/packed-data.md"} <= pages, pages


def test_examples_honour_the_cpu_switch():
    """An example that would use a GPU or start a process group reads RINGFT_EXAMPLE_DEVICE, so the
    test-suite runs it on CPU as written."""
    for b in BLOCKS:
        if "cuda" in b.code or _is_distributed(b):
            assert "RINGFT_EXAMPLE_DEVICE" in b.code, f"{b.id}: the example ignores RINGFT_EXAMPLE_DEVICE"


def test_every_fence_names_its_language():
    """A fence without a language could hide a Python example from the runner below."""
    for page in PAGES:
        for b in fenced_blocks(page):
            assert b.lang, f"{b.id}: give the code fence a language (python, bash, text, ...)"


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_doc_example_runs(block, tiny_model_dir, tmp_path):
    distributed = _is_distributed(block)
    code = block.code + (EPILOGUE if _is_own_loop(block) else "") + (TEARDOWN if distributed else "")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(
        os.environ,
        RINGFT_EXAMPLE_DEVICE="cpu",
        RINGFT_EXAMPLE_MODEL=tiny_model_dir,
        RINGFT_EXAMPLE_RTOL=repr(RTOL),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if distributed else []
    proc = subprocess.run(
        [sys.executable, *launcher, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{block.id}\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
    if _is_own_loop(block):
        assert proc.stdout.count("the own-loop example matches one process") == 2, proc.stdout
