"""Snapshots: the engine's state copied for a reader, under the engine lock, in O(requests).

`copy_state` copies two per-block arrays, per request its Sequence, counts, pending positions
and a (list, length) view of its block table (records.TableViews), the counters and the step
window; `build_snapshot` builds the record after the lock. No object per block and no token
lists: fills and owners are derived with numpy on demand (EngineSnapshot.kv_arrays), a block's
tokens only for that block (Inspector.block_info).
"""
from __future__ import annotations

from operator import attrgetter
from types import MappingProxyType
from typing import NamedTuple

from .records import EngineSnapshot, RequestRecord, TableViews


# per request, read under the lock in C-level passes (attrgetter and len through map): plain
# attributes only, so no Python frame runs with the lock held (where CPython may hand the GIL
# to another thread). Only what a step changes, one attribute a pass (a 9-attribute getter was
# most of the copy); fixed fields and counters that may be a step newer are read after the lock.
_TABLE = attrgetter("block_table")          # replaced on allocate/free: its object is read here
_COMPUTED = attrgetter("num_computed_tokens")
_TOKENS = attrgetter("token_ids")
_PENDING = attrgetter("pending")


class CopiedState(NamedTuple):
    """What a snapshot needs of the live engine, copied under the lock: immutable values and
    (list, length) views of block tables (see records.TableViews)."""
    seqs: list
    tables: list
    computed: list
    table_lens: list
    token_lens: list
    pending: list
    n_running: int
    block_ref: object           # np.ndarray copies
    block_hashed: object
    num_free_blocks: int
    prefix_hits: int
    prefix_queries: int
    evictions: int
    preemptions: int
    steps: tuple
    step_count: int


def engine_facts(model_name: str, architecture: str, num_params: int, dtype: str,
                 device: str, tp_size: int, block_size: int, num_blocks: int, kv_layout,
                 tp_layout, moe: dict | None, num_layers: int, num_heads: int,
                 num_kv_heads: int, async_scheduling: bool) -> MappingProxyType:
    """What a snapshot reports that never changes while an engine lives (computed once):
    EngineSnapshot's fields of those names."""
    return MappingProxyType(dict(locals()))


def copy_state(bm, sched, steps) -> CopiedState:
    """Call with the engine lock held. Everything is copied in C-level passes (the lock's hold
    is ~0.1 ms at 256 requests: short enough that the holder is rarely preempted for the GIL
    mid-copy); dicts and the record are built by `build_snapshot` once the lock is released."""
    seqs = [*sched.running, *sched.waiting]
    tables = list(map(_TABLE, seqs))
    return CopiedState(
        seqs, tables, list(map(_COMPUTED, seqs)), list(map(len, tables)),
        list(map(len, map(_TOKENS, seqs))),
        list(map(dict.copy, map(_PENDING, seqs))),     # positions still on the device
        len(sched.running), bm.ref_count.copy(), bm.hashed.copy(), bm.num_free_blocks,
        bm.prefix_hits, bm.prefix_queries, bm.evictions, sched.num_preemptions,
        steps.window(), steps.count)


def build_snapshot(state: CopiedState, facts: MappingProxyType) -> EngineSnapshot:
    """The EngineSnapshot from `copy_state`'s values (no lock needed: nothing here is live)."""
    views, tokens, records = {}, {}, {}
    for seq, table, done, n, n_tok, pend in zip(state.seqs, state.tables, state.computed,
                                                state.table_lens, state.token_lens,
                                                state.pending):
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
    seqs, n_running = state.seqs, state.n_running
    steps = state.steps
    timed = next((st for st in reversed(steps) if st.collective_time is not None
                  and not st.num_prefill_tokens), None)
    num_blocks = facts["num_blocks"]
    return EngineSnapshot(
        **facts, block_ref=state.block_ref, block_hashed=state.block_hashed,
        block_tables=TableViews(views), request_tokens=tokens,
        running=[s.request_id for s in seqs[:n_running]],
        waiting=[s.request_id for s in seqs[n_running:]], num_free_blocks=state.num_free_blocks,
        usage=(num_blocks - state.num_free_blocks) / num_blocks,
        prefix_hits=state.prefix_hits, prefix_queries=state.prefix_queries,
        evictions=state.evictions, preemptions=state.preemptions, steps=steps,
        collective_time=timed.collective_time if timed else None,
        collective_time_step=timed.step_id if timed else None,
        step_count=state.step_count, requests=records)
