"""``ringft eval-lines``: line retrieval on the CP ring (lines.py: CLI and run loop; prepare.py:
input checks and cases, before any model loads; model.py: loading; store.py: resumable results;
summary.py: tables and heatmap; checks.py: one-line input errors)."""
