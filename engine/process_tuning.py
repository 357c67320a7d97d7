"""Process-wide tuning a server opts into (app.py, the API server, the benchmarks): constructing
an engine changes nothing outside it.

- The GIL switch interval: the engine's thread shares the GIL with everything else in the
  process (the playground's handlers, the API's event loop). CPython makes a thread that wants
  the GIL wait up to the switch interval (5 ms by default) before the holder is told to let go,
  and a decode step's host work is ~0.5 ms: each such wait would stall the device for several
  steps. 0.2 ms bounds that wait at a fraction of a step (the cost: more frequent switches
  between threads that all want to run, ~µs each). GLASSBOX_SWITCH_INTERVAL_S overrides it.
- The heap frozen out of the cyclic GC (`freeze_heap`): everything loaded at start (torch,
  transformers, gradio, the model and the UI: ~600k objects) lives as long as the process; a
  full collection then walks only what requests made, instead of stopping every thread for up
  to a second (measured: 1.0 s -> 0 s on the 2-core machine under load).
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
