"""``python -m ringft.evals.compare BEFORE AFTER ...``: the command-line path of
:mod:`ringft.evals.lines.compare` (eval-lines runs side by side: one table, one figure)."""

from ringft.evals.lines.compare import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
