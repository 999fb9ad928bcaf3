"""``ringft eval-short``: the short-context regression check against the base model. The harness
task (``task``) and its report section (``report``)."""
