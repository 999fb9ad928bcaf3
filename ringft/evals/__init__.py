"""Evaluations on the CP ring. Shared by every task: ``task`` (what a task plugs in: ``EvalTask``, its
typed ``Options``, ``Context``, ``Runner``), ``harness`` (the run loop), ``prepare`` (checks and cases
before any model loads), ``model`` (loading), ``store`` (resumable results), ``figures`` (plots and
``summary.json``), ``sections`` (a report section's blocks) and ``checks`` (one-line input errors).
One package per task: ``lines`` (``ringft eval-lines``), ``ppl`` (``ringft eval-ppl``), ``niah``
and ``ruler`` (``ringft eval-niah`` / ``eval-ruler``, on the generators of ``long_tasks``),
``short`` (``ringft eval-short``) and ``report`` (``ringft eval-report``). Tasks import the shared
modules; no shared module imports a task."""
