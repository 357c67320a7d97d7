"""Plain records the engine publishes about itself: KV blocks, step traces, TP layout.

Everything here is host-side data (lists, ints, numpy) so the UI thread can read a snapshot
while the engine thread keeps running; nothing holds a reference to a device tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass
class BlockInfo:
    """One physical KV block as the block manager sees it."""
    block_id: int
    ref_count: int              # requests whose block table holds this block
    owners: list[str]           # their request ids
    num_filled: int             # slots written (0..block_size)
    prefix_hash: int | None     # hash-chain key when the block is full and cached, else None
    evictable: bool             # cached but free: reusable by a prefix hit until evicted
    token_ids: list[int]        # token ids held in the filled slots


class StepEntry(NamedTuple):
    """One request's share of a step (a tuple: one is made per request per step)."""
    request_id: str
    kind: str                   # "prefill" (a chunk of the prompt) or "decode"
    num_tokens: int
    start_pos: int              # position of the first token of this entry


@dataclass
class StepTrace:
    """What one engine step did and where its time went."""
    step_id: int
    wall_time: float            # time.time() at the start of the step
    entries: list[StepEntry]
    num_prefill_tokens: int
    num_decode_tokens: int
    t_schedule: float           # host seconds choosing the batch
    t_prepare: float            # host seconds building its inputs
    t_forward: float            # device seconds of forward + sampling (host launch time on a CPU)
    t_sample: float             # host seconds postprocessing (tokens, stop rules, text, probes)
    graph_bucket: int | None    # CUDA-graph batch size replayed, None when eager
    num_running: int
    num_waiting: int
    kv_usage: float             # fraction of blocks in use after the step
    expert_load: np.ndarray | None = None   # [num_moe_layers, num_experts] tokens routed this step
    collectives: int = 0        # all-reduce / gather calls issued by the forward (TP)
    t_launch: float = 0.0       # host seconds staging inputs and launching the forward + sampling
    t_wait: float = 0.0         # host seconds blocked waiting for the device (overlap: ~0)
    collective_time: float | None = None    # measured seconds in collectives (TP), if timed
    overlapped: bool = False    # scheduled while the previous step ran (overlap scheduling)


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
    blocks: list[BlockInfo]
    block_tables: dict[str, list[int]]      # request id -> physical block ids
    request_tokens: dict[str, int]          # request id -> tokens held in the cache
    running: list[str]
    waiting: list[str]
    num_free_blocks: int
    usage: float                            # used / total blocks (evictable counts as free)
    prefix_hits: int                        # blocks reused from the prefix cache
    prefix_queries: int                     # full blocks looked up
    evictions: int
    preemptions: int
    steps: list[StepTrace]                  # most recent last
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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
