"""``ringft eval-lines``: LongChat-style line retrieval. Cases fitted to a length (``cases``), LongChat's
case files (``files``), answer scoring (``scoring``), the harness task (``task``), its summary tables
and heatmap (``summary``), runs side by side (``compare``) and its report section (``report``)."""
