"""``ringft eval-ppl``: perplexity by length and NLL by position. The documents (``texts``), the NLL
of every token on the ring (``nll``), the variants evaluated (``variants``), the harness task
(``task``), its summaries and figure (``summary``), the peak-memory model (``memory``) and its
report section (``report``). ``ringft eval-short`` reads its documents with ``texts`` and ``nll`` too."""
