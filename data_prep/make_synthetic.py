"""Write a synthetic line-retrieval training set (``datasets.Dataset.save_to_disk``).

Each example is ``prompt + " " + answer + EOS`` with columns ``input_ids`` and ``labels``
(-100 except the answer tokens and EOS, or every token with ``--loss-on all``).

Example::

    python data_prep/make_synthetic.py --tokenizer demo --num-examples 2000 \\
        --seq-len 4096 --min-len 1024 --seed 0 --output data/synthetic_4k
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # allow `python data_prep/make_synthetic.py` from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ringft.utils.values import tokens_arg  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="Generate synthetic line-retrieval training data.")
    p.add_argument("--tokenizer", required=True, help="HF name/path, or 'demo'")
    p.add_argument("--num-examples", type=int, required=True)
    p.add_argument("--seq-len", type=tokens_arg, required=True, help="maximum tokens per example")
    p.add_argument("--min-len", type=tokens_arg, default=None, help="length budgets: [min-len, seq-len]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-on", choices=("answer", "all"), default="answer")
    p.add_argument(
        "--chat-template",
        choices=("auto", "yes", "no"),
        default="auto",
        help="wrap prompts in the tokenizer's chat template (auto: if it has one)",
    )
    p.add_argument("--output", type=Path, required=True, help="output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    from ringft.data.line_retrieval.training import make_synthetic_dataset
    from ringft.data.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    ds = make_synthetic_dataset(
        tokenizer,
        args.num_examples,
        args.seq_len,
        args.seed,
        loss_on=args.loss_on,
        min_len=args.min_len,
        chat_template={"auto": None, "yes": True, "no": False}[args.chat_template],
        progress=True,
    )
    ds.save_to_disk(str(args.output))
    lengths = [len(x) for x in ds["input_ids"]]
    print(
        f"wrote {len(ds)} examples to {args.output} "
        f"(tokens {min(lengths)}..{max(lengths)}, mean {sum(lengths) / len(lengths):.0f})"
    )


if __name__ == "__main__":
    main()
