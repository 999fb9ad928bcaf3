"""``ringft plan --capacity-table``: the planner's longest-sequence table runs, prints every row and
appends it to ``--out``; the numbers themselves come from ``max_seq_len_that_fits`` (tested in
tests/planner/test_planner.py)."""

from __future__ import annotations

from ringft.planner import plan_main
from ringft.planner.capacity import tokens_label


def test_capacity_table_prints_and_appends(tmp_path, capsys):
    out = tmp_path / "capacity.md"
    out.write_text("# before\n")
    assert plan_main(["--capacity-table", "--gpu-mem", "79.6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("Command: `ringft plan --capacity-table --gpu-mem 79.6`")
    rows = [line for line in printed.splitlines() if line.startswith("| llama")]
    assert len(rows) == 36  # 2 models x (8 full + 10 LoRA option sets)
    cells = {tuple(c.strip() for c in r.strip("|").split("|")[:3]): r for r in rows}
    ladder_top = cells[
        "llama-3-8b", "full", "+ attention tiles of 64K tokens (`train.attention_tile_tokens`)"
    ]
    assert ladder_top.split("|")[4].strip() not in ("0", "")  # fits one 80 GB GPU with every option
    assert cells["llama-3-8b", "full", "ckpt, full logits (HF default loss)"].split("|")[4].strip() == "0"
    assert out.read_text() == "# before\n\n" + printed


def test_capacity_table_bad_gpu_mem(capsys):
    assert plan_main(["--capacity-table", "--gpu-mem", "0"]) == 2
    assert "--gpu-mem 0 must be > 0 GiB" in capsys.readouterr().out


def test_tokens_label():
    assert [tokens_label(t) for t in (0, 65536, 1_250_000)] == ["0", "64K", "1.25M"]
