"""A sliding-window band as flash-attn ``window_size`` calls (see ``flash_backend``).

flash-attn 2 (2.3 on, the same in 2.4-2.8; ``csrc/flash_attn/flash_api.cpp`` and its docstring)
lets query ``i`` of ``seqlen_q`` see keys ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q
+ right]`` (bottom-right aligned). Before that it rewrites the arguments: a side ``>= seqlen_k``
becomes -1 (unbounded), ``causal`` sets ``right = 0``, and with one side bounded an unbounded other
side becomes ``seqlen_k`` -- which is *not* unbounded when ``seqlen_q > seqlen_k``. A row that sees
no key gets ``lse = +inf``.

The band "row ``i`` sees key ``j`` iff ``0 <= i + offset - j <= window - 1``" is therefore cut into
row segments, at the row from which the causal edge lies past the last key and at the row from
which the window's lower edge lies inside the keys, so that in every segment each bound is either
exact or truly unbounded after flash-attn's rewriting:

- causal edge inside, lower edge not: ``causal=True`` (bottom-right; exact because the segment's
  keys end at its last row);
- both inside: ``window_size = (window - 1, 0)``;
- neither: plain attention, ``(-1, -1)``;
- lower edge only: ``(left, right)`` with ``right >= seqlen_q - 1`` (the causal side never binds),
  where ``seqlen_q <= seqlen_k`` keeps flash-attn's ``seqlen_k`` substitute unbinding too.
"""

from __future__ import annotations

__all__ = ["flash_window_calls"]


def flash_window_calls(
    sq: int, sk: int, offset: int, window: int
) -> list[tuple[int, int, int, int, bool, tuple[int, int]]]:
    """``(q0, q1, k0, k1, causal, (left, right))`` per row segment of the band of ``sq`` rows and
    ``sk`` keys (every row sees a key: ``0 <= offset`` and ``sq - 1 + offset <= sk + window - 2``)."""
    w = window
    p0, p1 = offset, offset + sq  # row positions; keys sit at 0..sk-1
    cuts = sorted({p0, p1} | {x for x in (sk - 1, w - 1) if p0 < x < p1})
    calls = []
    for s, e in zip(cuts, cuts[1:]):
        x, y = max(0, s - w + 1), min(sk, e)  # keys the segment's rows see
        causal_inside, lower_inside = s < sk - 1, s >= w - 1
        if causal_inside and not lower_inside:
            win, causal = (-1, -1), True
        elif causal_inside:
            win, causal = (w - 1, 0), False
        elif not lower_inside:
            win, causal = (-1, -1), False
        else:
            right = (s - x) - (y - x) + (e - s)  # offset' - seqlen_k' + seqlen_q'
            win, causal = (w - 1 - right, right), False
        calls.append((s - offset, e - offset, x, y, causal, win))
    return calls
