"""The KV cache's data plane: the cache tensor's shape, dtype and strides, and where one logical
block lives: L x 2 regions (K and V of every layer) of [2, num_layers, num_blocks, block_size,
kv_heads, head_dim], each at a byte offset from the strides (rank 0's cache with TP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVRegion:
    layer: int
    which: str                  # "k" or "v"
    offset: int                 # bytes from the start of the cache tensor
    nbytes: int
    shape: tuple[int, ...]      # [block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class KVDataPlane:
    shape: tuple[int, ...]      # [2, num_layers, num_blocks, block_size, kv_heads, head_dim]
    dtype: str
    elem_bytes: int
    strides: tuple[int, ...]    # in elements
    total_bytes: int
    contiguous: bool

    @property
    def byte_strides(self) -> tuple[int, ...]:
        return tuple(s * self.elem_bytes for s in self.strides)

    @property
    def num_layers(self) -> int:
        return self.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def region_bytes(self) -> int:
        """One layer's K (or V) of one block: block_size × kv_heads × head_dim elements."""
        return math.prod(self.shape[3:]) * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """Everything one logical block holds: 2 × num_layers regions."""
        return 2 * self.num_layers * self.region_bytes

    def regions(self, block_id: int) -> list[KVRegion]:
        """The L × 2 regions of a block, K of every layer first, then V."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id must be in [0, {self.num_blocks}), got {block_id}")
        if not self.contiguous:
            raise ValueError("the KV cache tensor is not contiguous: a region is not one span")
        s0, s1, s2 = self.byte_strides[:3]
        return [KVRegion(layer, which, kv * s0 + layer * s1 + block_id * s2, self.region_bytes,
                         tuple(self.shape[3:]))
                for kv, which in enumerate("kv") for layer in range(self.num_layers)]


def kv_data_plane(kv_cache: torch.Tensor) -> KVDataPlane:
    return KVDataPlane(tuple(kv_cache.shape), str(kv_cache.dtype).replace("torch.", ""),
                       kv_cache.element_size(), tuple(kv_cache.stride()),
                       kv_cache.numel() * kv_cache.element_size(), kv_cache.is_contiguous())


def read_kv_cache_bytes(llm, offset: int, nbytes: int) -> bytes:
    """nbytes raw bytes of the (rank 0) KV cache tensor from a byte offset: what sits in memory
    at a region's address, read through the engine's public, locked API (between steps;
    EngineShutdownError once the engine is gone)."""
    return llm.read_kv_bytes(offset, nbytes)


def read_cache_bytes(kv: torch.Tensor, offset: int, nbytes: int) -> bytes:
    """nbytes raw bytes of a cache tensor from a byte offset (the caller holds the lock)."""
    total = kv.numel() * kv.element_size()
    if offset < 0 or nbytes < 0 or offset + nbytes > total:
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the KV cache's "
                         f"{total} bytes")
    if not kv.is_contiguous():
        raise ValueError("the KV cache tensor is not contiguous; read it through read_kv_block")
    flat = kv.detach().reshape(-1).view(torch.uint8)        # a view: no copy of the cache
    return flat[offset:offset + nbytes].cpu().numpy().tobytes()
