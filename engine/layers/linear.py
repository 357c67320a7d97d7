"""Linear layers sharded for tensor parallelism, each with its own weight loader.

Loaders receive either a tensor or a safetensors slice (`safe_open(...).get_slice(name)`), so
with TP a rank reads only its shard from disk. Fused parameters (qkv, gate_up) are filled piece
by piece: the loader is told which piece (`shard_id`) it is given.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernel_config import DEFAULT_KERNELS, KernelConfig
from ..parallel_state import divide, get_tp, get_tp_rank, get_tp_size
from .gemm import linear


def shape_of(w) -> list[int]:
    return list(w.shape) if isinstance(w, torch.Tensor) else list(w.get_shape())


def expect_size(w, dim: int, full: int) -> None:
    """The whole (unsharded) checkpoint tensor must have size `full` along dim: narrowing a
    larger one to a rank's piece would otherwise drop the rest silently."""
    shape = shape_of(w)
    if dim >= len(shape) or shape[dim] != full:
        raise ValueError(f"checkpoint tensor of shape {tuple(shape)} should have size {full} "
                         f"along dim {dim}")


def narrow(w, dim: int, start: int, size: int, full: int | None = None) -> torch.Tensor:
    """w[..., start:start+size, ...] along dim, for a tensor or a lazy safetensors slice
    (checked to have size `full` along dim first, when given)."""
    if full is not None:
        expect_size(w, dim, full)
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, size)
    index = [slice(None)] * len(w.get_shape())
    index[dim] = slice(start, start + size)
    return w[tuple(index)]


def materialize(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w[:]


def copy_checked(param: torch.Tensor, value: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"shape mismatch loading {name or 'parameter'}: checkpoint "
                         f"{tuple(value.shape)} vs model {tuple(param.shape)}")
    param.data.copy_(value)


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_dim: int | None,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__()
        self.kernels = kernels    # the engine's kernel choices (PDL)
        self.tp, self.tp_dim = get_tp(), tp_dim
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if self.tp_dim is not None and self.tp_size > 1 and param.dim() > self.tp_dim:
            size = param.shape[self.tp_dim]
            loaded = narrow(loaded, self.tp_dim, self.tp_rank * size, size,
                            full=size * self.tp_size)
        copy_checked(param, materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, pdl=self.kernels.pdl)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__(in_features, out_features, bias, None, kernels)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__(in_features, divide(out_features, get_tp_size(), "out_features"),
                         bias, 0, kernels)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 kernels: KernelConfig = DEFAULT_KERNELS):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, kernels)
        for p in self.parameters():
            p.shard_keys = set(range(len(output_sizes)))

    def weight_loader(self, param, loaded, shard_id: int) -> None:
        tp = self.tp_size
        size = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        loaded = narrow(loaded, 0, self.tp_rank * size, size, full=self.output_sizes[shard_id])
        copy_checked(param.data.narrow(0, offset, size), materialize(loaded))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused; heads split across ranks, KV heads replicated when
    tensor_parallel_size > num_kv_heads (each rank then holds the KV head its queries use)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, kernels: KernelConfig = DEFAULT_KERNELS):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_head_start = get_tp_rank() * self.num_kv_heads
        else:
            divide(tp, num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = get_tp_rank() * num_kv_heads // tp
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, 0, kernels)
        for p in self.parameters():
            p.shard_keys = {"q", "k", "v"}

    def weight_loader(self, param, loaded, shard_id: str) -> None:
        d = self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start, full = 0, q, self.tp_rank * q, self.total_heads * d
        elif shard_id == "k":
            offset, size, start, full = q, kv, self.kv_head_start * d, self.total_kv_heads * d
        else:
            offset, size, start, full = q + kv, kv, self.kv_head_start * d, self.total_kv_heads * d
        loaded = narrow(loaded, 0, start, size, full=full)
        copy_checked(param.data.narrow(0, offset, size), materialize(loaded))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs joined by an all-reduce.
    The bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 after_attention: bool = False, kernels: KernelConfig = DEFAULT_KERNELS):
        super().__init__(divide(in_features, get_tp_size(), "in_features"), out_features,
                         bias, 1, kernels)
        self.after_attention = after_attention  # o_proj: see gemm.linear

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:                      # bias: replicated
            copy_checked(param, materialize(loaded))
            return
        super().weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, after_attention=self.after_attention, pdl=self.kernels.pdl)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
