"""Byte axes in binary units (KiB, MiB, GiB), like every figure printed beside them.

Plotly labels a plain number axis with SI suffixes: a byte axis read "100B / 10B / 1B" (its
billions) beside GiB figures. These helpers give the axis its own ticks instead.
"""
from __future__ import annotations

import math

from views.figures_common import fmt_bytes


def _label(n: float) -> str:
    return fmt_bytes(n).replace(".0 ", " ")         # "1.0 GiB" -> "1 GiB"


def log_byte_axis(low: float, high: float, max_ticks: int = 7) -> dict:
    """Ticks at powers of two between `low` and `high` bytes (every 2**k, k spaced so at most
    `max_ticks` show), for an axis of type "log"."""
    lo, hi = max(0, math.floor(math.log2(max(low, 1)))), math.ceil(math.log2(max(high, 2)))
    stride = max(1, math.ceil((hi - lo + 1) / max_ticks))
    vals = [2.0 ** k for k in range(lo - lo % stride, hi + 1, stride) if low <= 2.0 ** k <= high]
    return dict(type="log", tickvals=vals, ticktext=[_label(v) for v in vals])


def linear_byte_axis(high: float, max_ticks: int = 6) -> dict:
    """Ticks from 0 to `high` bytes at a round step of its binary unit (e.g. 0, 128 MiB,
    256 MiB...) for a linear axis."""
    high = max(float(high), 1.0)
    unit = 1024 ** min(4, int(math.log(high, 1024))) if high >= 1024 else 1
    span = high / unit
    raw = span / max_ticks
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 2.5, 5, 10)
                if m * 10 ** math.floor(math.log10(raw)) >= raw), default=raw) * unit
    vals = [i * step for i in range(int(high // step) + 1)]
    return dict(tickvals=vals, ticktext=[_label(v) for v in vals])
