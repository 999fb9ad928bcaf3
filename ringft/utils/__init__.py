"""Helpers below every other layer, none of them attention math.

``values`` (typed value checks with one error style, for every user-facing setting: recipe keys,
command-line flags, trainer keywords), ``options`` (the one table of the options that recipes,
trainer keywords and command lines share: names, flags, old spellings) and ``spawn`` (N gloo
processes with a timeout, for tests and setup checks). ``ringft.ops`` never imports ``values``: the
operator's own input checks are in :mod:`ringft.ops.ring_checks`.
"""
