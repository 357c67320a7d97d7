"""Launch configs for the MoE expert kernels: per-shape JSON tables tuned on a device by
`bench/tune_moe.py`, keyed by token count, with a heuristic default where no table matches.

Two paths compute the same experts (engine/layers/moe.py picks one per call): "gemv"
(moe_gemv.py, a weight stream over the active experts, for decode batches) and "grouped"
(fused_moe.py: moe_align, then tensor-core GEMMs over each expert's run, for prefill).

Tables are named like vLLM's, by what changes the best launch:
`moe_E=128_N=768_H=2048_bf16_NVIDIA_H200.json` (N = the per-rank intermediate size). Their
"configs" map a token count M to a config; a call uses the nearest tuned M. The directory is
engine/kernels/configs/, or KernelConfig.moe_config_dir (`GLASSBOX_MOE_CONFIG_DIR`).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# Untuned default: the GEMV path up to this many (token, k) pairs (M = 4 at top-8). On an H200
# the grouped path already reads ~90 % of its floor from M = 8 (bench/RESULTS.md, 2026-11-29).
DEFAULT_GEMV_MAX_PAIRS = 32
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class KernelTile:
    """The launch of one expert GEMM kernel."""
    block_n: int          # output columns per program
    block_k: int          # reduction elements per step
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1      # grouped path: M-blocks that sweep the N-tiles together (L2 reuse)

    def short(self) -> str:
        g = f" g{self.group_m}" if self.group_m != 1 else ""
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages}{g}"


@dataclass(frozen=True)
class MoEGemvConfig:
    """Decode path: w13 GEMV + SiLU-and-mul per pair, then w2 GEMV x weight summed per token."""
    w13: KernelTile
    w2: KernelTile
    path = "gemv"  # class attribute, not a field

    def short(self) -> str:
        return f"gemv w13[{self.w13.short()}] w2[{self.w2.short()}]"


@dataclass(frozen=True)
class MoEKernelConfig:
    """Grouped path: block_m (token, k) pairs of one expert per M-block, then one tile per GEMM."""
    block_m: int
    w13: KernelTile
    w2: KernelTile
    path = "grouped"

    def short(self) -> str:
        return f"grouped bm{self.block_m} w13[{self.w13.short()}] w2[{self.w2.short()}]"


MoEConfig = MoEGemvConfig | MoEKernelConfig


def config_to_dict(cfg: MoEConfig) -> dict:
    d = {"path": cfg.path, "w13": asdict(cfg.w13), "w2": asdict(cfg.w2)}
    if isinstance(cfg, MoEKernelConfig):
        d["block_m"] = cfg.block_m
    return d


def config_from_dict(d: dict) -> MoEConfig:
    """Inverse of config_to_dict; extra keys (timings the tuner stores beside) are ignored."""
    try:
        w13, w2 = KernelTile(**d["w13"]), KernelTile(**d["w2"])
        if d["path"] == "gemv":
            return MoEGemvConfig(w13, w2)
        if d["path"] == "grouped":
            return MoEKernelConfig(int(d["block_m"]), w13, w2)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"bad MoE config entry {d}: {exc}") from exc
    raise ValueError(f"bad MoE config entry {d}: path must be 'gemv' or 'grouped'")


def device_name(device: torch.device | None) -> str:
    """'NVIDIA H200' for a CUDA device; 'cpu' elsewhere (no table: the defaults apply)."""
    if device is None or device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def config_file_name(num_experts: int, inter_size: int, hidden: int, dtype: torch.dtype,
                     device: str) -> str:
    dev = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    return f"moe_E={num_experts}_N={inter_size}_H={hidden}_{_DTYPE_NAMES.get(dtype, str(dtype))}_{dev}.json"


def config_dir(directory: str | Path | None = None) -> Path:
    """The table directory: `directory` (KernelConfig.moe_config_dir), or the tables shipped."""
    return Path(directory) if directory else CONFIG_DIR


@functools.lru_cache(maxsize=None)
def load_table(path: str) -> tuple[tuple[int, MoEConfig], ...] | None:
    """(M, config) pairs sorted by M from one table file, or None when there is no such file."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        raw = json.loads(p.read_text())
        table = tuple(sorted((int(m), config_from_dict(c)) for m, c in raw["configs"].items()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"MoE config table {p} is unreadable ({exc}); fix it or delete it "
                         f"(the kernels then fall back to their defaults)") from exc
    return table or None


def nearest(table, num_tokens: int) -> MoEConfig:
    """The entry tuned at the nearest token count (ties: the smaller)."""
    return min(table, key=lambda mc: (abs(mc[0] - num_tokens), mc[0]))[1]


def default_gemv(elem_size: int = 2) -> MoEGemvConfig:
    """Untuned guess for an H200 (the skinny GEMM's M = 1 findings): w13 streams 2 gate + 2 up
    rows a program, one 16-byte vector a thread per row per step; w2 whole rows of I a step."""
    scale = max(1, elem_size // 2)
    return MoEGemvConfig(KernelTile(2, 512 // scale, 2, 3), KernelTile(2, 256 // scale, 1, 3))


def default_grouped(num_tokens: int, top_k: int, num_experts: int) -> MoEKernelConfig:
    """By average (token, k) pairs per expert: small tiles and many programs while the GEMM is a
    weight stream, big tiles once it is a real GEMM (the sweep of bench/moe_kernels.py, H200)."""
    per_expert = num_tokens * top_k / num_experts
    t = KernelTile
    if per_expert <= 4:
        return MoEKernelConfig(16, t(32, 128, 4, 4), t(64, 128, 4, 4))
    if per_expert <= 16:
        return MoEKernelConfig(32, t(64, 64, 4, 4, 8), t(128, 64, 4, 4, 8))
    if per_expert <= 128:
        return MoEKernelConfig(64, t(64, 64, 4, 4, 8), t(128, 64, 4, 4, 8))
    return MoEKernelConfig(128, t(128, 64, 8, 3, 8), t(128, 64, 8, 3, 8))


def default_config(num_tokens: int, top_k: int, num_experts: int, elem_size: int = 2) -> MoEConfig:
    if num_tokens * top_k <= DEFAULT_GEMV_MAX_PAIRS:
        return default_gemv(elem_size)
    return default_grouped(num_tokens, top_k, num_experts)


def pick_config(num_tokens: int, top_k: int, num_experts: int, inter_size: int, hidden: int,
                dtype: torch.dtype, device: torch.device | None,
                directory: str | Path | None = None) -> MoEConfig:
    """The tuned config for this shape and device at the nearest token count, else the default.
    `directory`: where the tables are (None: engine/kernels/configs/)."""
    table = _table_for(num_experts, inter_size, hidden, dtype, device_name(device),
                       str(config_dir(directory)))
    if table is None:
        return default_config(num_tokens, top_k, num_experts, dtype.itemsize)
    return nearest(table, num_tokens)


@functools.lru_cache(maxsize=None)
def _table_for(num_experts, inter_size, hidden, dtype, device: str, directory: str):
    return load_table(str(Path(directory) / config_file_name(num_experts, inter_size, hidden, dtype, device)))


def write_table(path: str | Path, configs: dict[int, dict], **meta) -> None:
    """configs: M -> config_to_dict(cfg) plus any extra keys (timings). meta: shape and device."""
    body = dict(meta, configs={str(m): configs[m] for m in sorted(configs)})
    Path(path).write_text(json.dumps(body, indent=1) + "\n")
