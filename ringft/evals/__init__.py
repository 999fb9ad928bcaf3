"""Evaluations on the CP ring: one harness (``harness``: run loop; ``plan``: checks and cases before
any model loads; ``model``: loading; ``store``: resumable results; ``figures``: plots and
``summary.json``) and its tasks: ``lines`` (``ringft eval-lines``; ``summary``, ``compare``),
``niah`` and ``ruler`` (``ringft eval-niah`` / ``eval-ruler`` on ``generation``), ``ppl``
(``ringft eval-ppl``; ``nll``, ``texts``, ``ppl_summary``, ``memory``), ``short`` (``ringft
eval-short``) and ``report`` (``ringft eval-report``); ``checks``: one-line input errors."""
