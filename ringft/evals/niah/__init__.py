"""``ringft eval-niah``: passkey and needle retrieval over a length x depth grid. The harness task
(``task``, on :mod:`ringft.evals.long_tasks.generation`) and its report section (``report``)."""
