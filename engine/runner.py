"""Runner: all the engine may ask of the model side, one local ModelRunner (TP=1) or the
TPDriver over N ranks (engine/parallel.py). EngineCore, LLM, the inspector and the anatomy use
only these names, so a driver that implements exactly them is a drop-in for the local runner.
Facts are rank 0's (with TP, its shards; tp_layout() describes every rank).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .kernel_config import KernelConfig
from .step_inputs import StepInputs
from .step_output import StepOutput


@runtime_checkable
class Runner(Protocol):
    # ---- facts, read by inspect(), the anatomy views and LLM ---------------------------------
    model: torch.nn.Module | None       # rank 0's module (None after shutdown)
    kv_cache: torch.Tensor | None       # [2, layers, blocks, block_size, kv_heads, head_dim]
    device: torch.device
    # True: a guided step's bitmask may be a callable (grammar_masks.LateMask) that the runner
    # calls after launching the forward, so guided requests keep overlap scheduling; False: the
    # mask must be filled before execute_step (EngineCore drains the step in flight first)
    fills_masks_late: bool
    kernel_config: KernelConfig         # the kernel choices every rank runs with

    @property
    def num_params(self) -> int:
        """Parameters of the whole model (every rank's shards together)."""

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers with a sparse MoE block ([] for a dense model)."""

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one KV block on one rank (K and V, every layer)."""

    def tp_layout(self) -> list:
        """Per rank: which heads and experts it holds, and its KV bytes (engine/tp_layout.py)."""

    def read_kv_block(self, block_id: int, layer: int, head: int, kv: int) -> np.ndarray:
        """K (kv=0) or V (kv=1) of one block, one layer and one of rank 0's KV heads:
        [block_size, head_dim] fp32 on the host."""

    # ---- life cycle, called by LLM in this order -----------------------------------------------
    def profile_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """How many KV blocks fit on every rank."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        ...

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs for decode batches (a no-op on the CPU or with enforce_eager)."""

    def execute_step(self, inp: StepInputs) -> StepOutput:
        """Launch one step (forward + sampling); the result's host copies are in flight."""

    def check_workers(self) -> None:
        """Raise WorkerDiedError if a worker process died (a local runner has none)."""

    def shutdown(self) -> None:
        """Free the weights, the KV cache and any worker process; idempotent."""

