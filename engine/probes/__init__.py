"""Introspection: what the engine records about itself.

spec.py (ProbeSpec: what a watched request records) -> plan.py (which rows of one step) ->
buffers.py (device buffers the forward writes, CUDA-graph variants) -> manager.py (host side:
folds each step's results into traces) -> trace.py (RequestTrace). Engine-wide records (the
snapshot, step traces, TP layout) are not probes: engine/records.py, engine/snapshot.py,
engine/step_history.py, engine/tp_layout.py.
"""
