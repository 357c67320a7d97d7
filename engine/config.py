"""EngineConfig: every engine setting, validated up front with messages that say what to change."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgumentError
from .kernel_config import KernelConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def resolve_dtype(dtype, device: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise InvalidArgumentError(f"dtype={dtype!r} is not supported; use one of "
                                   f"{sorted(_DTYPES)}", "dtype")
    return _DTYPES[dtype]


def resolve_device(device) -> str:
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgumentError(f"device={device!r} was asked for but CUDA is not available "
                                   "here; pass device='cpu'", "device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InvalidArgumentError(f"device={device!r} is not supported; use 'cpu' or 'cuda'",
                                   "device")
    return device


@dataclass
class EngineConfig:
    model: str
    device: str | None = None
    dtype: object = None
    tensor_parallel_size: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    load_format: str = "auto"       # "auto": safetensors; "dummy": random weights (benchmarks)
    trace_history: int = 256        # step traces kept for inspect()
    max_traces: int = 64            # watched requests' traces kept (the newest)
    record_expert_load: bool = False    # MoE expert load per step (the playground turns it on)
    async_scheduling: bool | None = None    # overlap scheduling; None: on a GPU only
    # kernel and fusion choices by name (engine/kernel_config.py: KernelConfig's fields); None
    # or a name left out: the GLASSBOX_* environment variable, else the default
    kernels: dict | None = None
    # speculative decoding: vLLM's --speculative-config (a dict or its JSON string; see
    # engine/spec_decode/config.py), None: off unless a request asks (num_speculative_tokens)
    speculative_config: object = None

    def __post_init__(self):
        self.device = resolve_device(self.device)
        self.torch_dtype = resolve_dtype(self.dtype, self.device)
        def positive(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}", name)
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "trace_history", "max_traces"):
            positive(name)
        if self.num_kv_blocks is not None:
            positive("num_kv_blocks")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.block_size > 256:
            raise InvalidArgumentError(f"block_size={self.block_size} is too large; use 1..256 "
                                       "(16 is usual)", "block_size")
        if self.device.startswith("cuda") and self.block_size & (self.block_size - 1):
            raise InvalidArgumentError(f"block_size={self.block_size}: the GPU kernels need a "
                                       "power of two (1, 2, 4, ..., 256); any size works on the "
                                       "CPU", "block_size")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidArgumentError("gpu_memory_utilization must be in (0, 1], got "
                                       f"{self.gpu_memory_utilization}", "gpu_memory_utilization")
        if self.kernels is not None:
            KernelConfig.parse_overrides(self.kernels)      # unknown names, bad values: raise now
            self.kernels = dict(self.kernels)
        from .spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.load_format not in ("auto", "dummy"):
            raise InvalidArgumentError(f"load_format={self.load_format!r}; use 'auto' or 'dummy'",
                                       "load_format")
        if self.device.startswith("cuda") and self.tensor_parallel_size > torch.cuda.device_count():
            raise InvalidArgumentError(f"tensor_parallel_size={self.tensor_parallel_size} but "
                                       f"only {torch.cuda.device_count()} GPU(s) are visible",
                                       "tensor_parallel_size")
