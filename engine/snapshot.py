"""take_snapshot: the engine's state copied for a reader, under the engine lock, in O(requests).

What is copied under the lock (`copy_state`): two per-block arrays (a memcpy each), each
request's id, computed-token count and a (list, length) view of its block table (see
records.TableViews), counters and the step window (one shared tuple per step); the record is
built after the lock is released (`build_snapshot`). No object per block, no token lists: fills and owners are derived
from the tables with numpy when a reader asks (records.EngineSnapshot.kv_arrays), and a block's
tokens are read on demand for that block only (LLM.block_info).
"""
from __future__ import annotations

from operator import attrgetter, itemgetter

from .records import EngineSnapshot, RequestRecord, TableViews


# per request, read under the lock in C-level passes (operator.attrgetter and len through map):
# plain attributes only, no property, so no Python frame runs while the lock is held (a frame
# is where CPython may hand the GIL to another thread, with the engine lock still held)
_FACTS = attrgetter("request_id", "block_table", "num_computed_tokens", "pending", "token_ids",
                    "params", "grammar", "num_masked_steps", "annotation")


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
    facts = list(map(_FACTS, [*sched.running, *sched.waiting]))
    table_lens = list(map(len, map(itemgetter(1), facts)))
    token_lens = list(map(len, map(itemgetter(4), facts)))
    pending = list(map(dict.copy, map(itemgetter(3), facts)))   # positions still on the device
    steps = llm.core.steps.window()
    return (llm, facts, table_lens, token_lens, pending, n_running, bm.ref_count.copy(),
            bm.hashed.copy(), bm.num_free_blocks, bm.prefix_hits, bm.prefix_queries, bm.evictions,
            sched.num_preemptions, steps, llm.core.steps.count)


def build_snapshot(state: tuple) -> EngineSnapshot:
    """The EngineSnapshot from `copy_state`'s values (no lock needed: nothing here is live)."""
    (llm, facts, table_lens, token_lens, pending, n_running, ref, hashed, free, hits, queries,
     evictions, preemptions, steps, step_count) = state
    bm = llm.block_manager          # fixed facts only below (sizes), never live state
    views, tokens, records = {}, {}, {}
    for (rid, table, computed, _, _, params, g, masked, note), n, n_tok, pend in zip(
            facts, table_lens, token_lens, pending):
        resolved = min(pend) if pend else n_tok     # Sequence.num_resolved_tokens, as copied
        # a grammar's plain counters only, never its matcher (the engine thread may be using
        # it); read after the lock, so they may be a step newer than the tables
        records[rid] = RequestRecord(params.summary, g is not None, masked,
                                     g.num_allowed if g is not None else None,
                                     g.vocab_size if g is not None else 0, note)
        if n:
            views[rid] = (table, n)
            # a token still on the device (overlap scheduling) has no id here yet
            tokens[rid] = min(computed, resolved)
    running = [f[0] for f in facts[:n_running]]
    waiting = [f[0] for f in facts[n_running:]]
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
