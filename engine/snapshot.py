"""take_snapshot: the engine's state copied for a reader, under the engine lock, in O(requests).

What is copied under the lock: two per-block arrays (a memcpy each), a (list, length) view of
each request's block table (see records.TableViews), the queues, counters and the step window
(one shared tuple per step). No object per block, no token lists: fills and owners are derived
from the tables with numpy when a reader asks (records.EngineSnapshot.kv_arrays), and a block's
tokens are read on demand for that block only (LLM.block_info).
"""
from __future__ import annotations

from .records import EngineSnapshot, KVLayout, RequestRecord, TableViews


def take_snapshot(llm) -> EngineSnapshot:
    """Call with the engine lock held."""
    bm, sched, runner = llm.block_manager, llm.scheduler, llm.runner
    views, tokens, records = {}, {}, {}
    running = [s.request_id for s in sched.running]
    waiting = [s.request_id for s in sched.waiting]
    for queue in (sched.running, sched.waiting):
        for seq in queue:           # ~1 µs a request: this loop is most of the lock's hold
            g = seq.grammar         # plain ints of the grammar, never its matcher (in use)
            records[seq.request_id] = RequestRecord(
                seq.params.summary, g is not None, seq.num_masked_steps,
                g.num_allowed if g is not None else None, g.vocab_size if g is not None else 0,
                seq.annotation)
            table = seq.block_table
            if not table:
                continue
            rid, pending = seq.request_id, seq.pending
            views[rid] = (table, len(table))
            # a token still on the device (overlap scheduling) has no id here yet
            tokens[rid] = min(seq.num_computed_tokens,
                              min(pending) if pending else len(seq.token_ids))
    steps = llm.core.steps.window()
    timed = next((st for st in reversed(steps) if st.collective_time is not None
                  and not st.num_prefill_tokens), None)
    used = bm.num_blocks - bm.num_free_blocks
    return EngineSnapshot(
        model_name=llm.model_name, architecture=llm.architecture, num_params=llm.num_params,
        dtype=llm.dtype_name, device=llm.device, tp_size=llm.tp_size,
        block_size=bm.block_size, num_blocks=bm.num_blocks,
        block_ref=bm.ref_count.copy(), block_hashed=bm.hashed.copy(),
        block_tables=TableViews(views), request_tokens=tokens,
        running=running, waiting=waiting, num_free_blocks=bm.num_free_blocks,
        usage=used / bm.num_blocks, prefix_hits=bm.prefix_hits, prefix_queries=bm.prefix_queries,
        evictions=bm.evictions, preemptions=sched.num_preemptions, steps=steps,
        kv_layout=llm.kv_layout, tp_layout=llm.tp_layout, moe=llm.moe_facts,
        num_layers=llm.hf_config.num_hidden_layers,
        num_heads=llm.hf_config.num_attention_heads,
        num_kv_heads=llm.hf_config.num_key_value_heads,
        collective_time=timed.collective_time if timed else None,
        collective_time_step=timed.step_id if timed else None,
        async_scheduling=llm.async_scheduling, step_count=llm.core.steps.count,
        requests=records)
