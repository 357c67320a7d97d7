"""Introspection: what the engine records about itself.

spec.py (ProbeSpec: what a watched request records) -> plan.py (which rows of one step) ->
buffers.py (device buffers the forward writes, CUDA-graph variants) -> manager.py (host side:
folds each step's results into traces) -> trace.py (RequestTrace) ; snapshot.py and inspect.py
(EngineSnapshot: KV blocks, queues, step traces), tp_layout.py (what each TP rank holds).
"""
