"""Inspector: the glass. Every read of a live engine's state goes through it, by these rules:

- Under the engine lock only C-level copies in O(what changed) (engine/snapshot.py) and
  references to a trace's rows; records, texts and figures are built after it is released.
- While the engine is busy its own thread copies a reader's snapshot at the next step boundary
  (engine/snapshot_handoff.py); an idle engine's last copy is handed out again, lock-free,
  while nothing changed (engine/generation_lock.py).
- Nothing handed out is live: snapshots and traces are immutable records.
"""
from __future__ import annotations

import time
from collections import deque
from functools import partial

from .errors import InvalidArgumentError
from .records import BlockInfo, EngineSnapshot
from .sampling_params import is_int
from .snapshot import build_snapshot, copy_state
from .snapshot_handoff import SnapshotHandoff, without_gc


class Inspector:
    def __init__(self, loop, facts, block_manager, scheduler, steps, probes,
                 runner, num_layers: int, handoff: SnapshotHandoff):
        self.loop, self.facts = loop, facts
        self.lock = loop.lock
        self.bm, self.scheduler, self.steps = block_manager, scheduler, steps
        self.probes, self.runner = probes, runner
        self.num_layers = num_layers
        self.snapshots = handoff
        self._copy = partial(copy_state, block_manager, scheduler, steps)
        self._kept = None           # (generation, CopiedState): the last reader-side copy
        # how long inspect() / trace() held the engine lock, newest last (bench/watched.py):
        # wall seconds, and the reader thread's CPU seconds (the work itself, without the
        # time the OS or the GIL kept the thread waiting)
        self.lock_hold_s = {"inspect": deque(maxlen=4096), "trace": deque(maxlen=4096)}
        self.lock_hold_cpu_s = {"inspect": deque(maxlen=4096), "trace": deque(maxlen=4096)}

    def _held(self, what: str, t0: float, c0: float) -> None:
        self.lock_hold_s[what].append(time.perf_counter() - t0)
        self.lock_hold_cpu_s[what].append(time.thread_time() - c0)

    def inspect(self) -> EngineSnapshot:
        """A consistent snapshot of the engine (KV blocks as arrays, queues, recent steps),
        copied in O(requests): by the engine thread at its next step boundary while it is busy
        (the reader holds no lock), under the lock by the reader when the engine is idle, and
        handed out again without any lock while nothing has changed since that copy."""
        self.loop.check_open()
        if not self.loop.on_engine_thread():
            state = self.snapshots.take(self.loop.busy)
            if state is not None:
                return build_snapshot(state, self.facts)
        kept = self._kept
        if kept is not None and kept[0] == self.lock.generation:
            self.snapshots.reused += 1      # nothing entered a writer's section since the copy
            return build_snapshot(kept[1], self.facts)
        with self.lock.reading():
            t0, c0 = time.perf_counter(), time.thread_time()
            self.loop.check_open()
            gen = self.lock.generation
            state = without_gc(self._copy)
            self._held("inspect", t0, c0)
        self._kept = (gen, state)
        return build_snapshot(state, self.facts)

    def trace(self, request_id: str):
        """The RequestTrace of a watched request, complete so far, as a frozen copy that the
        engine never changes afterwards (read it again for newer rows). KeyError if the
        request was never watched, or its trace was evicted. Reference copies of the rows under
        the lock; new tokens' texts are decoded after it; attention rows still on the device
        move to the host when a reader first uses one (`AttentionStep.probs`)."""
        with self.lock.reading():
            t0, c0 = time.perf_counter(), time.thread_time()
            tr = self.probes.read(request_id)
            self._held("trace", t0, c0)
        start = len(tr.token_texts)
        new = self.probes.decode_texts(tr)       # the tokenizer runs with no lock held
        if new:
            with self.lock.reading():
                self.probes.keep_texts(request_id, start, new)
        return tr

    def traced_requests(self) -> list[str]:
        """Request ids that have a trace, newest first."""
        with self.lock.reading():
            return list(reversed(self.probes.traces))

    def steps_since(self, cursor: int = 0) -> tuple[tuple, int]:
        """(the step traces recorded since `cursor` that the ring still holds, the new cursor):
        O(new steps) under the lock. Start with cursor 0 (or a snapshot's `step_count`)."""
        with self.lock.reading():
            return self.steps.since(cursor)

    def block_info(self, block_id: int, viewer_salt: str | None = None) -> BlockInfo:
        """One physical block now, with the token ids it holds and its prefix hash: read on
        demand for this block only (a hover card), under the lock in O(block_size).

        A block written or held by a salted request (`cache_salt`: the client asked for its
        prefix to be private) keeps its text for a viewer with the same salt: anyone else gets
        its counts, no token ids and no hash (`hidden`)."""
        from .cache_salt import salt_tag
        b = self._block_id(block_id)
        viewer = salt_tag(viewer_salt) if viewer_salt is not None else None
        with self.lock.reading():
            self.loop.check_open()
            bm = self.bm
            seqs = self.scheduler.all_sequences() if bm.ref_count[b] > 0 else []
            holders = [s for s in seqs if b in s.block_table]
            ids = bm.block_token_ids(b, holders)
            ref, block = int(bm.ref_count[b]), bm.blocks[b]
            h = block.prefix_hash
            tags = {s.salt_tag for s in holders} | ({block.salt_tag} if h is not None else set())
        hidden = any(t is not None and t != viewer for t in tags)
        return BlockInfo(b, ref, [s.request_id for s in holders], len(ids),
                         None if hidden else h, ref == 0 and h is not None,
                         [] if hidden else ids, hidden=hidden)

    def _block_id(self, block_id) -> int:
        n = self.facts["num_blocks"]
        if not is_int(block_id) or not 0 <= block_id < n:
            raise InvalidArgumentError(f"block_id must be an integer in [0, {n}), got "
                                       f"{block_id!r}", "block_id")
        return int(block_id)

    def read_kv_block(self, block_id: int, layer: int, head: int, which: str = "k"):
        """K or V of one physical block for one layer and KV head: [block_size, head_dim]."""
        if which not in ("k", "v"):
            raise InvalidArgumentError("which must be 'k' or 'v'", "which")
        b = self._block_id(block_id)
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer must be in [0, {self.num_layers})", "layer")
        with self.lock.reading():
            self.loop.check_open()
            return self.runner.read_kv_block(b, layer, head, 0 if which == "k" else 1)

    def read_kv_bytes(self, offset: int, nbytes: int) -> bytes:
        """Raw bytes of rank 0's KV cache tensor from a byte offset (the Anatomy tab's view
        of one region), read between steps under the lock."""
        from .anatomy.kv_regions import read_cache_bytes
        with self.lock.reading():
            self.loop.check_open()
            return read_cache_bytes(self.runner.kv_cache, offset, nbytes)

    def model_parts(self):
        """(model, kv_cache) of rank 0, for engine/anatomy (fixed while the engine lives);
        EngineShutdownError once the engine is shut down."""
        with self.lock.reading():
            self.loop.check_open()
            return self.runner.model, self.runner.kv_cache

    def stats(self) -> dict:
        """Engine-wide counters, cheap (no per-block copies): for /metrics and health checks."""
        with self.lock.reading():
            bm, sched = self.bm, self.scheduler
            return {"num_running": len(sched.running), "num_waiting": len(sched.waiting),
                    "kv_usage": (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks,
                    "prefix_hits": bm.prefix_hits, "prefix_queries": bm.prefix_queries,
                    "num_preemptions": sched.num_preemptions, "block_size": bm.block_size,
                    "spec_decode": sched.spec_stats.as_dict(),
                    "alive": self.loop.alive}

    def release(self) -> None:
        """At shutdown: drop the copies (they reference the engine's sequences)."""
        self.snapshots.clear()
        self._kept = None
