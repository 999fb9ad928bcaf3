"""``ringft eval-ruler``: RULER's synthetic tasks and the effective length. The harness task
(``task``, on :mod:`ringft.evals.long_tasks.generation`) and its report section (``report``)."""
