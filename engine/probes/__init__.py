"""Introspection: what the engine records about itself. spec.py (what a watched request
records) -> plan.py (which rows of one step) -> buffers.py (what the forward writes, on the
device) -> manager.py (folds each step into traces, host side) -> trace.py (RequestTrace).
Engine-wide records are not probes: engine/records.py, snapshot.py, step_history.py, tp_layout.py.
"""
