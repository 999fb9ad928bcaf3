"""README's Python examples run as written (issue 17, item 3): each ```python block is extracted from
README.md and run under ``torchrun`` on 2 CPU processes with ``RINGFT_EXAMPLE_DEVICE=cpu`` (the
switch the examples honour: gloo, fp32) and ``RINGFT_EXAMPLE_MODEL`` pointing at a tiny saved LLaMA
with the shipped demo tokenizer, so the examples cannot drift from the code.

The own-loop example gets an epilogue that checks it against the oracle: one process, no ring, the
whole batch. Tolerance: the ring reorders fp32 sums (attention over <= 2 x 256 keys, the loss over
as many tokens and a vocabulary of 1658, hidden 32, intermediate 64): eps32 x their total length,
relative to the loss and to each gradient's largest entry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
RTOL = torch.finfo(torch.float32).eps * (2 * 256 + 2 * 256 + 1658 + 32 + 64)

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
print(f"rank {rank}: the README example matches one process", flush=True)
"""


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringft.data.line_retrieval.tokenizer import load_tokenizer

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
    assert any("apply_ring_attention" in b and "loss_normalization" in b for b in BLOCKS)
    assert all("RINGFT_EXAMPLE_DEVICE" in b for b in BLOCKS), "every example honours the CPU switch"


@pytest.mark.numerics
@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_on_two_cpu_processes(index, tiny_model_dir, tmp_path):
    code = BLOCKS[index]
    if "apply_ring_attention" in code:
        code += EPILOGUE
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(code)
    env = dict(
        os.environ,
        RINGFT_EXAMPLE_DEVICE="cpu",
        RINGFT_EXAMPLE_MODEL=tiny_model_dir,
        RINGFT_EXAMPLE_RTOL=repr(RTOL),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    if "apply_ring_attention" in BLOCKS[index]:
        assert proc.stdout.count("the README example matches one process") == 2, proc.stdout
