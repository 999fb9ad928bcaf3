"""``ringft eval-report``: one page from the ``--output`` folders of ``ringft eval-*`` runs
(``page``), one section per task (each task's ``report`` module)."""
