"""How many bytes of weights a config needs per GPU, before anything is allocated: a model that
cannot fit is refused with the memory it needs and the tensor-parallel size that would fit,
instead of an out-of-memory error half way through loading."""
from __future__ import annotations

from .errors import OutOfCapacityError


def param_count(cfg) -> int:
    """Parameters of a Qwen2/2.5/3 dense or MoE config (the engine's own layout)."""
    h, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or h // hq
    qwen3 = "Qwen3" in (cfg.architectures or [""])[0]
    bias = getattr(cfg, "attention_bias", False) if qwen3 else True
    attn = h * (hq + 2 * hkv) * d + hq * d * h + ((hq + 2 * hkv) * d if bias else 0)
    attn += 2 * d if qwen3 else 0                               # q_norm, k_norm
    norms = 2 * h
    from .models.qwen_moe import is_moe_layer
    total = V * h + h                                           # embedding, final norm
    if not getattr(cfg, "tie_word_embeddings", False):
        total += V * h                                          # LM head
    for i in range(L):
        if getattr(cfg, "num_experts", 0) and is_moe_layer(cfg, i):
            E, inter = cfg.num_experts, cfg.moe_intermediate_size
            mlp = E * 3 * h * inter + h * E                     # experts + router
            shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
            if shared:
                mlp += 3 * h * shared + h                       # shared expert + its gate
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += attn + norms + mlp
    return total


def check_fits(cfg, tp_size: int, dtype_bytes: int, gpu_bytes: int, utilization: float,
               dtype_name: str) -> None:
    """Raise ValueError when one GPU cannot hold its share of the weights."""
    total = param_count(cfg) * dtype_bytes
    per_gpu = total / tp_size
    usable = gpu_bytes * utilization
    if per_gpu <= usable:
        return
    gb = 1e9
    fits = next((t for t in (2, 4, 8, 16) if t > tp_size and total / t <= usable * 0.9
                 and cfg.num_attention_heads % t == 0), None)
    advice = (f"use tensor parallelism: --tp {fits} (tensor_parallel_size={fits}) holds "
              f"{total / fits / gb:.1f} GB per GPU" if fits else
              "it does not fit this machine's GPUs at any tensor-parallel size")
    raise OutOfCapacityError(
        f"the weights need {total / gb:.1f} GB in {dtype_name} ({per_gpu / gb:.1f} GB per GPU "
        f"at tensor_parallel_size={tp_size}), but one GPU has {gpu_bytes / gb:.1f} GB "
        f"({usable / gb:.1f} GB at gpu_memory_utilization={utilization}); {advice}",
        "tensor_parallel_size")


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else None (the check is skipped)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits_host(cfg, dtype_bytes: int, dtype_name: str) -> None:
    """Raise ValueError when the weights alone need more than 90% of the host memory available
    now: a config with absurd sizes (10^6 layers) is refused in a moment, before anything is
    allocated, instead of running for half a minute into an allocator error."""
    available = available_host_bytes()
    if available is None:
        return
    try:
        total = param_count(cfg) * dtype_bytes
    except (TypeError, AttributeError, ZeroDivisionError) as e:   # a size missing or not a number
        raise ValueError(f"cannot size the model from its config.json: {e}") from None
    if total <= available * 0.9:
        return
    gb = 1e9
    raise ValueError(
        f"the weights need {total / gb:.1f} GB in {dtype_name} (num_hidden_layers="
        f"{cfg.num_hidden_layers}, hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}), "
        f"but this machine has {available / gb:.1f} GB of memory available; check the "
        "checkpoint's config.json, or use a smaller model or a GPU")


# sizes no real checkpoint comes near (Qwen3-235B: 94 layers, hidden 4096, 128 experts): a
# config.json beyond them is refused before transformers reads it (it builds per-layer lists
# and validates them element by element: 10^6 layers took minutes before any allocation)
SIZE_CEILINGS = {"num_hidden_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
                 "moe_intermediate_size": 1 << 20, "vocab_size": 1 << 23,
                 "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 14,
                 "num_experts": 1 << 14, "num_experts_per_tok": 1 << 10,
                 "max_position_embeddings": 1 << 24}


def check_config_sizes(raw: dict, file: str) -> None:
    """ValueError naming the file and field when a size in config.json is not a positive
    integer within SIZE_CEILINGS (checked on the raw JSON, before anything reads it)."""
    for name, ceiling in SIZE_CEILINGS.items():
        if name not in raw or raw[name] is None:
            continue
        v = raw[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{file}: {name} must be a non-negative integer, got {v!r}")
        if v > ceiling:
            raise ValueError(f"{file}: {name}={v:,} is beyond any real model (at most "
                             f"{ceiling:,} here); the checkpoint's config.json is broken")
