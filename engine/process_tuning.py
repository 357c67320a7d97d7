"""Process-wide tuning a server opts into (app.py, the API server, the benchmarks): constructing
an engine changes nothing outside it.

- The GIL switch interval: a thread that wants the GIL waits up to it (5 ms by default) before
  the holder lets go, and a decode step's host work is ~0.5 ms; 0.2 ms bounds the engine
  thread's wait at a fraction of a step. GLASSBOX_SWITCH_INTERVAL_S overrides it.
- `freeze_heap`: what was loaded at start (~600k objects) lives as long as the process; frozen
  out of the cyclic GC, a full collection walks only what requests made (measured: pauses of
  1.0 s -> 0 s on the 2-core machine under load).
"""
from __future__ import annotations

import gc
import os
import sys

GIL_SWITCH_INTERVAL_S = 2e-4


def shorten_gil_switch_interval() -> None:
    want = float(os.environ.get("GLASSBOX_SWITCH_INTERVAL_S") or GIL_SWITCH_INTERVAL_S)
    if want > 0 and sys.getswitchinterval() > want:
        sys.setswitchinterval(want)


def freeze_heap() -> None:
    """Collect, then move everything alive out of the collector's reach (O(1))."""
    gc.collect()
    gc.freeze()


def tune_process() -> None:
    """Both, for a process whose job is serving: call once everything is loaded."""
    shorten_gil_switch_interval()
    freeze_heap()
