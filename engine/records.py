"""Plain records the engine publishes about itself: KV blocks, step traces, TP layout.

Host-side data only (ints, numpy arrays, tuples), never a device tensor or a live engine
structure, so a reader can hold a snapshot while the engine runs. Per-block state arrives as
arrays (engine/snapshot.py); per-block objects and figure data are derived on demand.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, NamedTuple

import numpy as np


@dataclass
class BlockInfo:
    """One physical KV block as the block manager sees it (derived from a snapshot's arrays;
    `token_ids` is filled only by `LLM.block_info`, which reads one block on demand)."""
    block_id: int
    ref_count: int              # requests whose block table holds this block
    owners: list[str]           # their request ids
    num_filled: int             # slots written (0..block_size)
    prefix_hash: int | None     # hash-chain key of a cached block (block_info only, else None)
    evictable: bool             # cached but free: reusable by a prefix hit until evicted
    token_ids: list[int] = field(default_factory=list)   # held tokens (block_info only)
    hidden: bool = False        # a salted request's block seen by another viewer: counts only


class StepEntry(NamedTuple):
    """One request's share of a step (a tuple: one is made per request per step)."""
    request_id: str
    kind: str                   # "prefill" (a chunk of the prompt) or "decode"
    num_tokens: int
    start_pos: int              # position of the first token of this entry


class StepEntries:
    """One step's requests, in columns of exact tuples (str and int): a sequence of StepEntry.

    Why columns: the garbage collector stops tracking a plain tuple of atomic values after its
    first pass, never a NamedTuple: one StepEntry per request per step kept ~65k tracked objects
    in the ring at 256 requests, and every full collection walked them all (4 ms on 2 CPU
    cores) inside the engine thread. Iterating makes StepEntry tuples on demand."""
    __slots__ = ("request_ids", "kinds", "num_tokens", "start_pos")

    def __init__(self, request_ids=(), kinds=(), num_tokens=(), start_pos=()):
        self.request_ids: tuple[str, ...] = tuple(request_ids)
        self.kinds: tuple[str, ...] = tuple(kinds)
        self.num_tokens: tuple[int, ...] = tuple(num_tokens)
        self.start_pos: tuple[int, ...] = tuple(start_pos)

    @classmethod
    def of(cls, entries) -> "StepEntries":
        """StepEntries from any iterable of StepEntry (itself when it already is one)."""
        if isinstance(entries, StepEntries):
            return entries
        rows = list(entries)
        return cls(*zip(*rows)) if rows else cls()

    def __len__(self) -> int:
        return len(self.request_ids)

    def __iter__(self):
        return map(StepEntry._make, zip(self.request_ids, self.kinds, self.num_tokens,
                                        self.start_pos))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        return StepEntry(self.request_ids[i], self.kinds[i], self.num_tokens[i],
                         self.start_pos[i])

    def __eq__(self, other) -> bool:
        try:
            return list(self) == list(other)
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"StepEntries({list(self)!r})"


@dataclass
class StepTrace:
    """What one engine step did and where its time went."""
    step_id: int
    wall_time: float            # time.time() at the start of the step
    entries: StepEntries        # a list of StepEntry is converted (columns: see StepEntries)
    num_prefill_tokens: int
    num_decode_tokens: int
    t_schedule: float           # host seconds choosing the batch
    t_prepare: float            # host seconds building its inputs
    t_forward: float            # device seconds of forward + sampling (host launch time on a CPU)
    t_sample: float             # host seconds postprocessing (tokens, stop rules, text, probes)
    graph_bucket: int | None    # graph replayed: decode batch or prefill tokens; None: eager
    num_running: int
    num_waiting: int
    kv_usage: float             # fraction of blocks in use after the step
    expert_load: np.ndarray | None = None   # [num_moe_layers, num_experts] tokens routed this step
    collectives: int = 0        # all-reduce / gather calls issued by the forward (TP)
    t_launch: float = 0.0       # host seconds staging inputs and launching the forward + sampling
    t_wait: float = 0.0         # host seconds blocked waiting for the device (overlap: ~0)
    collective_time: float | None = None    # measured seconds in collectives (TP), if timed
    overlapped: bool = False    # scheduled while the previous step ran (overlap scheduling)
    # cascade attention (engine/cascade.py): rows that read a shared prefix once, its tokens,
    # and the KV bytes (every layer, this rank) the step did not read because of it
    cascade_rows: int = 0
    cascade_tokens: int = 0
    kv_bytes_saved: int = 0
    # speculative decoding (engine/spec_decode): draft tokens verified this step, how many the
    # target accepted, and per verify entry (request id, drafted token ids, number accepted)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    verifies: tuple = ()
    t_propose: float = 0.0      # host seconds proposing drafts (part of t_schedule)

    def __post_init__(self):
        self.entries = StepEntries.of(self.entries)


@dataclass
class RankLayout:
    """Which slice of the model one tensor-parallel rank holds."""
    rank: int
    q_heads: list[int]
    kv_heads: list[int]
    mlp_slice: tuple[int, int] | None        # [start, end) of the intermediate dim (dense MLP)
    expert_slice: tuple[int, int] | None     # [start, end) of each expert's intermediate dim
    vocab_slice: tuple[int, int]
    kv_cache_bytes: int


@dataclass
class KVLayout:
    """Physical layout of the paged KV cache on one rank."""
    shape: tuple[int, ...]      # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    dtype: str
    bytes_per_block: int        # K and V, all layers
    bytes_per_token: int
    total_bytes: int


class TableViews(Mapping):
    """Request id -> its block table, from (live list, length) pairs taken under the lock.

    A block table only grows while its request holds blocks (freeing it replaces the list), so
    the first `length` ids of the list never change: the view is immutable, and taking it costs
    O(1) per request instead of a copy of every table under the engine lock."""

    def __init__(self, views: dict[str, tuple[list[int], int]]):
        self._views = views
        self._cache: dict[str, list[int]] = {}

    def __getitem__(self, rid: str) -> list[int]:
        t = self._cache.get(rid)
        if t is None:
            lst, n = self._views[rid]
            t = self._cache[rid] = lst[:n]
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def parts(self) -> tuple[list[str], list[list[int]], list[int]]:
        """(request ids, their live lists, the lengths taken under the lock), in order: for
        C-level passes over every table (itertools.islice(list, length)) without a slice each."""
        ids = list(self._views)
        lists, lens = (list(x) for x in zip(*self._views.values())) if ids else ([], [])
        return ids, lists, lens


def table_parts(tables: Mapping) -> tuple[list[str], list, list[int]]:
    """TableViews.parts() for any mapping of request id -> block table."""
    if isinstance(tables, TableViews):
        return tables.parts()
    ids = list(tables)
    lists = [tables[r] for r in ids]
    return ids, lists, list(map(len, lists))


@dataclass
class KVBlockArrays:
    """Per-block facts derived from a snapshot with numpy (outside the engine lock)."""
    filled: np.ndarray          # [num_blocks] slots written
    owner: np.ndarray           # [num_blocks] index into `owners` of the first owner, -1 none
    owners: list[str]           # request ids in block-table order
    # every (block, owner index) pair of the blocks held by more than one request, sorted by
    # block, owners in table order within a block
    shared_blocks: np.ndarray
    shared_owners: np.ndarray

    @cached_property
    def more_owners(self) -> dict[int, list[int]]:
        """Shared block id -> every owner index."""
        out: dict[int, list[int]] = {}
        for b, o in zip(self.shared_blocks.tolist(), self.shared_owners.tolist()):
            out.setdefault(b, []).append(o)
        return out


class RequestRecord(NamedTuple):
    """One live request's choices and guided-decoding state, for its row in the playground
    (a tuple of plain values: one is made per request per snapshot, under the lock)."""
    sampling: str               # SamplingParams.summary: "temp 0.7 · top_p 0.9 · presence 0.5"
    guided: bool                # a grammar constrains its tokens (structured output, tools)
    masked_steps: int           # steps whose token the grammar constrained
    allowed: int | None         # tokens its latest mask allowed (None: no mask yet)
    vocab: int                  # the mask's width: allowed of vocab, the rest masked
    note: str                   # what the API attached (LLM.annotate: tool calls so far) or ""


@dataclass
class EngineSnapshot:
    """A consistent copy of the engine's state, taken between two steps."""
    model_name: str
    architecture: str
    num_params: int
    dtype: str
    device: str
    tp_size: int
    block_size: int
    num_blocks: int
    block_ref: np.ndarray                   # [num_blocks] int32: requests holding each block
    block_hashed: np.ndarray                # [num_blocks] bool: holds a registered prefix
    block_tables: Mapping[str, list[int]]   # request id -> physical block ids
    request_tokens: dict[str, int]          # request id -> tokens held in the cache
    running: list[str]
    waiting: list[str]
    num_free_blocks: int
    usage: float                            # used / total blocks (evictable counts as free)
    prefix_hits: int                        # blocks reused from the prefix cache
    prefix_queries: int                     # full blocks looked up
    evictions: int
    preemptions: int
    steps: tuple[StepTrace, ...]            # most recent last (a bounded window)
    kv_layout: KVLayout
    tp_layout: list[RankLayout] = field(default_factory=list)
    moe: dict | None = None                 # {"num_experts", "top_k", "moe_layers"} for MoE models
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    # TP: the latest measured time in collectives per decode step (seconds) and its step id
    collective_time: float | None = None
    collective_time_step: int | None = None
    async_scheduling: bool = False
    step_count: int = 0                     # steps ever recorded: a cursor for LLM.steps_since
    requests: dict[str, RequestRecord] = field(default_factory=dict)   # live requests by id

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- derived outside the lock, on demand --------------------------------------------------
    @property
    def block_evictable(self) -> np.ndarray:
        """[num_blocks] bool: cached but free (a later prefix hit revives it)."""
        return (self.block_ref == 0) & self.block_hashed

    @cached_property
    def kv_arrays(self) -> KVBlockArrays:
        """Fill and owners of every block, from the block tables: a few vectorised passes over
        the blocks held (~1 ms for 16k), whatever the number of requests."""
        bs, n = self.block_size, self.num_blocks
        filled = self.block_hashed * np.int32(bs)          # a cached block is full
        owner = np.full(n, -1, np.int32)
        owners, lists, ns = table_parts(self.block_tables)
        lens = np.array(ns, np.int64)
        total = int(lens.sum())
        sb = so = np.zeros(0, np.int64)
        if total:
            # one C-level pass over the tables' first `length` ids (no slice per table)
            allb = np.fromiter(itertools.chain.from_iterable(map(itertools.islice, lists, ns)),
                               np.int64, total)
            allo = np.repeat(np.arange(len(owners), dtype=np.int32), lens)
            starts = np.cumsum(lens) - lens
            logical = np.arange(total) - np.repeat(starts, lens)        # index in its table
            known = np.fromiter(map(self.request_tokens.get, owners, itertools.repeat(0)),
                                np.int64, len(owners))
            f = np.clip(np.repeat(known, lens) - logical * bs, 0, bs).astype(np.int32)
            np.maximum.at(filled, allb, f)
            # the first owner in table order: write in reverse, so the first write wins
            owner[allb[::-1]] = allo[::-1]
            shared = self.block_ref[allb] > 1
            order = np.argsort(allb[shared], kind="stable")     # by block, table order kept
            sb, so = allb[shared][order], allo[shared][order]
        return KVBlockArrays(filled, owner, owners, sb, so)

    def block(self, block_id: int) -> BlockInfo:
        """One block as a record (no token ids: `LLM.block_info` reads those on demand)."""
        a = self.kv_arrays
        b = int(block_id)
        ids = a.more_owners.get(b) or ([int(a.owner[b])] if a.owner[b] >= 0 else [])
        ref = int(self.block_ref[b])
        return BlockInfo(b, ref, [a.owners[i] for i in ids], int(a.filled[b]),
                         None, bool(ref == 0 and self.block_hashed[b]))

    @cached_property
    def blocks(self) -> list[BlockInfo]:
        """Every block as a record, built on demand outside the lock (tests, small caches;
        the views work on the arrays)."""
        return [self.block(i) for i in range(self.num_blocks)]
