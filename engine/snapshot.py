"""take_snapshot: the engine's state copied for a reader, under the engine lock, in O(requests).

What is copied under the lock (`copy_state`): two per-block arrays (a memcpy each), each
request's Sequence object, computed-token count, token count, device-pending positions and a
(list, length) view of its block table (see records.TableViews), counters and the step window
(one shared tuple per step); the record is built after the lock is released
(`build_snapshot`). No object per block, no token lists: fills and owners are derived from the
tables with numpy when a reader asks (records.EngineSnapshot.kv_arrays), and a block's
tokens are read on demand for that block only (LLM.block_info).
"""
from __future__ import annotations

from operator import attrgetter

from .records import EngineSnapshot, RequestRecord, TableViews


# per request, read under the lock in C-level passes (operator.attrgetter and len through map):
# plain attributes only, no property, so no Python frame runs while the lock is held (a frame
# is where CPython may hand the GIL to another thread, with the engine lock still held). Only
# what a step changes is read here, one attribute a pass (a 9-attribute getter was most of the
# copy); what stays fixed for a request's life (its id, params, grammar object) and the plain
# counters that may be a step newer (masked steps, the API's note) are read from the Sequence
# after the lock.
_TABLE = attrgetter("block_table")          # replaced on allocate/free: its object is read here
_COMPUTED = attrgetter("num_computed_tokens")
_TOKENS = attrgetter("token_ids")
_PENDING = attrgetter("pending")


def take_snapshot(llm) -> EngineSnapshot:
    """Call with the engine lock held. Everything is copied in C-level passes (the lock's hold
    is ~0.1 ms at 256 requests: short enough that the holder is rarely preempted for the GIL
    mid-copy); dicts and the record are built by `build_snapshot` once the lock is released."""
    return build_snapshot(copy_state(llm))


def copy_state(llm) -> tuple:
    """What a snapshot needs of the live engine, under the lock: immutable values and
    (list, length) views of block tables (see records.TableViews)."""
    bm, sched = llm.block_manager, llm.scheduler
    n_running = len(sched.running)
    seqs = [*sched.running, *sched.waiting]
    tables = list(map(_TABLE, seqs))
    computed = list(map(_COMPUTED, seqs))
    table_lens = list(map(len, tables))
    token_lens = list(map(len, map(_TOKENS, seqs)))
    pending = list(map(dict.copy, map(_PENDING, seqs)))     # positions still on the device
    steps = llm.core.steps.window()
    return (llm, seqs, tables, computed, table_lens, token_lens, pending, n_running,
            bm.ref_count.copy(), bm.hashed.copy(), bm.num_free_blocks, bm.prefix_hits,
            bm.prefix_queries, bm.evictions, sched.num_preemptions, steps, llm.core.steps.count)


def build_snapshot(state: tuple) -> EngineSnapshot:
    """The EngineSnapshot from `copy_state`'s values (no lock needed: nothing here is live)."""
    (llm, seqs, tables, computed, table_lens, token_lens, pending, n_running, ref, hashed, free,
     hits, queries, evictions, preemptions, steps, step_count) = state
    bm = llm.block_manager          # fixed facts only below (sizes), never live state
    views, tokens, records = {}, {}, {}
    for seq, table, done, n, n_tok, pend in zip(seqs, tables, computed, table_lens, token_lens,
                                                pending):
        rid, g = seq.request_id, seq.grammar
        resolved = min(pend) if pend else n_tok     # Sequence.num_resolved_tokens, as copied
        # a grammar's plain counters only, never its matcher (the engine thread may be using
        # it); read after the lock, so they may be a step newer than the tables
        records[rid] = RequestRecord(seq.params.summary, g is not None, seq.num_masked_steps,
                                     g.num_allowed if g is not None else None,
                                     g.vocab_size if g is not None else 0, seq.annotation)
        if n:
            views[rid] = (table, n)
            # a token still on the device (overlap scheduling) has no id here yet
            tokens[rid] = min(done, resolved)
    running = [s.request_id for s in seqs[:n_running]]
    waiting = [s.request_id for s in seqs[n_running:]]
    timed = next((st for st in reversed(steps) if st.collective_time is not None
                  and not st.num_prefill_tokens), None)
    used = bm.num_blocks - free
    return EngineSnapshot(
        model_name=llm.model_name, architecture=llm.architecture, num_params=llm.num_params,
        dtype=llm.dtype_name, device=llm.device, tp_size=llm.tp_size,
        block_size=bm.block_size, num_blocks=bm.num_blocks,
        block_ref=ref, block_hashed=hashed,
        block_tables=TableViews(views), request_tokens=tokens,
        running=running, waiting=waiting, num_free_blocks=free,
        usage=used / bm.num_blocks, prefix_hits=hits, prefix_queries=queries,
        evictions=evictions, preemptions=preemptions, steps=steps,
        kv_layout=llm.kv_layout, tp_layout=llm.tp_layout, moe=llm.moe_facts,
        num_layers=llm.hf_config.num_hidden_layers,
        num_heads=llm.hf_config.num_attention_heads,
        num_kv_heads=llm.hf_config.num_key_value_heads,
        collective_time=timed.collective_time if timed else None,
        collective_time_step=timed.step_id if timed else None,
        async_scheduling=llm.async_scheduling, step_count=step_count, requests=records)
