"""Shared pieces of the bench suite: model configs, floors, timing, the HF peer, tables, targets."""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` puts bench/, not the repo, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

DEMO_DIR = REPO_ROOT / "assets" / "demo-qwen3"

# ---------------------------------------------------------------- model shapes (BENCH.md)

# Each entry: HF config class name and its kwargs. "tiny*" are the CPU smoke-test stand-ins.
MODEL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)),
    "qwen3-8b": ("Qwen3Config", dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)),
    "qwen2.5-72b": ("Qwen2Config", dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=8192,
        intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)),
    "tiny": ("Qwen3Config", dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)),
    "tiny-moe": ("Qwen3MoeConfig", dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=1000, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)),
}
TINY_OF = {"qwen3-0.6b": "tiny", "qwen3-8b": "tiny", "qwen3-30b-a3b": "tiny-moe", "demo": "tiny",
           "qwen2.5-72b": "tiny", "qwen3-235b-a22b": "tiny-moe"}

_MODEL_DIRS: dict[str, Path] = {}


def hf_config(name: str):
    """The transformers config object for a named shape."""
    import transformers
    cls_name, kwargs = MODEL_SHAPES[name]
    return getattr(transformers, cls_name)(**kwargs)


def model_dir(name: str) -> Path:
    """A directory with config.json + generation_config.json for `name` (no weights), or the demo
    checkpoint. Built once per process with transformers' save_pretrained, so HF and the engine read
    the same file."""
    if name == "demo":
        if not (DEMO_DIR / "config.json").exists():
            raise FileNotFoundError(f"no demo checkpoint at {DEMO_DIR}; build it with tools/ first")
        return DEMO_DIR
    if name in _MODEL_DIRS:
        return _MODEL_DIRS[name]
    from transformers import GenerationConfig
    cfg = hf_config(name)
    path = Path(tempfile.mkdtemp(prefix=f"glassbox-bench-{name}-"))
    cfg.save_pretrained(path)
    # Real Qwen checkpoints spell these keys the pre-v5 way; write both so any reader finds them.
    raw = json.loads((path / "config.json").read_text())
    raw.setdefault("rope_theta", raw.get("rope_parameters", {}).get("rope_theta", 1e6))
    if "num_local_experts" in raw:
        raw.setdefault("num_experts", raw["num_local_experts"])
    raw.setdefault("torch_dtype", "bfloat16")
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.bos_token_id).save_pretrained(path)
    _MODEL_DIRS[name] = path
    return path


def vocab_size(name: str) -> int:
    if name == "demo":
        return int(json.loads((DEMO_DIR / "config.json").read_text())["vocab_size"])
    return int(MODEL_SHAPES[name][1]["vocab_size"])


# ---------------------------------------------------------------- device, timing

def resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def bench_setup(model: str, device: str | None, dtype, tiny: bool
                ) -> tuple[str, torch.device, torch.dtype | None]:
    """What a bench's main runs on: the model (its tiny stand-in under --tiny), device, dtype."""
    model = TINY_OF.get(model, model) if tiny else model
    return model, resolve_device(device), parse_dtype(dtype)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Run fn once; wall seconds with the device drained on both sides."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def graph_us(calls: list[Callable[[], Any]], replays: int) -> float:
    """µs per call: the calls back to back in one CUDA graph (each run once before, to compile
    and allocate outside the capture), median of `replays` replays."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def free_memory(device: torch.device | None = None) -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return "out of memory" in str(exc).lower()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"CPU ({platform.processor() or platform.machine()}, {cpu_threads()} threads)"


def cpu_threads() -> int:
    """Cores this process may use (the cgroup/affinity view, which os.cpu_count ignores)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- floors

def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None,
                           iters: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        _, t = timed(lambda: dst.copy_(src), device)
        times.append(t)
    del src, dst
    return 2 * nbytes / median(times)


def measure_matmul_flops(device: torch.device, n: int | None = None, iters: int = 10,
                         dtype: torch.dtype | None = None) -> float:
    """Dense matmul rate in FLOP/s (bf16 on GPU, fp32 on CPU)."""
    dtype = dtype or default_dtype(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    times = []
    for _ in range(iters):
        _, t = timed(lambda: a @ b, device)
        times.append(t)
    return 2 * n ** 3 / median(times)


def measure_floors(device: torch.device) -> list[dict]:
    """The two floors BENCH.md asks for, as rows."""
    bw = measure_copy_bandwidth(device)
    fl = measure_matmul_flops(device)
    dt = "bf16" if device.type == "cuda" else "fp32"
    log(f"floors: copy {bw / 1e12:.3f} TB/s, {dt} matmul {fl / 1e12:.1f} TFLOP/s")
    return [row("floors", "-", "device", "copy_bandwidth", bw / 1e12, "TB/s", "read+write bytes"),
            row("floors", "-", "device", f"matmul_{dt}", fl / 1e12, "TFLOP/s")]


# ---------------------------------------------------------------- rows and tables

# Every row ever made, in order: run_all keeps the figures of a section that ran out of time.
ROW_LOG: list[dict] = []


def row(bench: str, model: str, system: str, metric: str, value: float | None, unit: str,
        note: str = "") -> dict:
    """One measured figure. `system` is "glassbox", an HF peer ("hf-generate", "hf-generate_batch"),
    "ratio" (glassbox / peer), or "device"."""
    r = {"bench": bench, "model": model, "system": system, "metric": metric,
         "value": None if value is None else float(value), "unit": unit, "note": note}
    ROW_LOG.append(r)
    return r


def error_row(bench: str, model: str, system: str, exc: BaseException) -> dict:
    kind = "OOM" if is_oom(exc) else type(exc).__name__
    msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    log(f"{bench}/{model}/{system} failed: {kind}: {msg}")
    return row(bench, model, system, "error", None, "", f"{kind}: {msg}")


def ratio_row(bench: str, model: str, metric: str, ours: dict | None, peer: dict | None,
              higher_is_better: bool = True) -> list[dict]:
    """glassbox / peer (or peer / glassbox for times), so > 1 always means we are faster."""
    if not ours or not peer or not ours.get("value") or not peer.get("value"):
        return []
    r = ours["value"] / peer["value"] if higher_is_better else peer["value"] / ours["value"]
    return [row(bench, model, "ratio", metric, r, "x", f"glassbox vs {peer['system']}")]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}"
    return "" if v is None else str(v)


def format_table(rows: list[dict], columns: list[str] | None = None, markdown: bool = False) -> str:
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in cs) + " |" for cs in cells]
        return "\n".join(lines)
    widths = [max(len(c), *(len(cs[i]) for cs in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cs, widths)) for cs in cells]
    return "\n".join(lines)


ROW_COLUMNS = ["bench", "model", "system", "metric", "value", "unit", "note"]


def print_rows(rows: list[dict], title: str = "") -> None:
    if title:
        print(f"\n== {title} ==", flush=True)
    print(format_table(rows, ROW_COLUMNS), flush=True)


# ---------------------------------------------------------------- targets (BENCH.md)

@dataclass(frozen=True)
class Target:
    bench: str
    model: str
    system: str
    metric: str
    op: str          # ">=" or "<="
    threshold: float
    label: str

    def check(self, rows: list[dict]) -> tuple[float | None, str]:
        for r in rows:
            if (r["bench"], r["model"], r["system"], r["metric"]) == \
                    (self.bench, self.model, self.system, self.metric) and r["value"] is not None:
                v = r["value"]
                ok = v >= self.threshold if self.op == ">=" else v <= self.threshold
                return v, "met" if ok else "missed"
        return None, "not measured"


# BENCH.md's targets (keep in step with it)
TARGETS = [
    Target("latency", "qwen3-0.6b", "glassbox", "decode_tok_s", ">=", 1000,
           "Qwen3-0.6B batch-1 decode >= 1,000 tok/s"),
    Target("latency", "qwen3-0.6b", "glassbox", "ttft_ms_1024", "<=", 8,
           "Qwen3-0.6B TTFT (1,024-token prompt) <= 8 ms"),
    Target("throughput", "qwen3-0.6b", "glassbox", "output_tok_s", ">=", 20000,
           "Qwen3-0.6B throughput >= 20,000 tok/s"),
    Target("moe", "qwen3-30b-a3b", "glassbox", "decode_tok_s", ">=", 350,
           "Qwen3-30B-A3B batch-1 decode >= 350 tok/s"),
    Target("moe", "qwen3-30b-a3b", "glassbox", "ttft_ms_1024", "<=", 25,
           "Qwen3-30B-A3B TTFT (1,024 tokens) <= 25 ms"),
    Target("moe", "qwen3-30b-a3b", "glassbox", "output_pct_of_floor", ">=", 80,
           "Qwen3-30B-A3B throughput (256 requests) >= 80 % of the workload's bandwidth floor"),
    Target("probes", "qwen3-0.6b", "glassbox", "throughput_slowdown_pct[norms+routing]", "<=", 3,
           "probes on (norms+routing+trace), throughput: <= 3 % slowdown"),
    Target("probes", "qwen3-0.6b", "glassbox", "decode_slowdown_pct[norms+routing]", "<=", 3,
           "probes on (norms+routing+trace), batch-1 decode: <= 3 % slowdown"),
    Target("probes", "qwen3-0.6b", "glassbox", "ttft_slowdown_pct[norms+routing]", "<=", 10,
           "probes on (norms+routing+trace), TTFT: <= 10 % slowdown"),
    Target("probes", "qwen3-0.6b", "glassbox", "decode_slowdown_pct[attention]", "<=", 10,
           "watched-request attention capture, batch 1: <= 10 % slowdown"),
    Target("cpu", "demo", "glassbox", "decode_tok_s", ">=", 50,
           "CPU demo checkpoint batch-1 decode >= 50 tok/s (2 cores)"),
    Target("cpu", "demo", "ratio", "decode_tok_s", ">=", 1.0,
           "CPU demo checkpoint >= 1.0x HF"),
]


def target_rows(rows: list[dict]) -> list[dict]:
    out = []
    for t in TARGETS:
        v, status = t.check(rows)
        out.append({"target": t.label, "measured": v, "status": status})
    return out


# ---------------------------------------------------------------- workloads

@dataclass
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(num_requests: int, seed: int = 0, prompt_len: tuple[int, int] = (100, 1024),
                  output_len: tuple[int, int] = (100, 1024), id_high: int = 10000,
                  id_stream: int = 0) -> list[Request]:
    """The nano-vllm workload: lengths from `seed`; token ids < id_high from a stream picked by
    `id_stream`, so repeats keep the exact lengths but never hit the previous run's prefix cache."""
    lens = random.Random(seed)
    ids = random.Random(seed * 1_000_003 + id_stream)
    out = []
    for _ in range(num_requests):
        p, o = lens.randint(*prompt_len), lens.randint(*output_len)
        out.append(Request([ids.randrange(id_high) for _ in range(p)], o))
    return out


def random_prompt(length: int, id_high: int, stream: int) -> list[int]:
    rng = random.Random(1_000_000 + stream)
    return [rng.randrange(id_high) for _ in range(length)]


# ---------------------------------------------------------------- our engine

def build_engine(name: str, device: torch.device, dtype: torch.dtype | None = None, **kwargs):
    """LLM on a named shape: dummy weights for config-only shapes, real ones for the demo."""
    from engine import LLM
    load_format = "auto" if name == "demo" else "dummy"
    dtype = dtype if dtype is not None else default_dtype(device)
    if device.type == "cpu" and kwargs.get("num_kv_blocks") is None:
        # Sizing the cache from free memory makes sense on a GPU; on a CPU take a few sequences'
        # worth, so a run never reserves most of the host's RAM.
        per_seq = -(-kwargs.get("max_model_len", 4096) // kwargs.get("block_size", 16))
        kwargs["num_kv_blocks"] = max(64, 4 * per_seq)
    log(f"building glassbox {name} on {device} ({dtype}, load_format={load_format})")
    t0 = time.perf_counter()
    llm = LLM(str(model_dir(name)), device=str(device), dtype=dtype, load_format=load_format,
              **kwargs)
    log(f"glassbox {name} ready in {time.perf_counter() - t0:.1f}s")
    from engine.process_tuning import tune_process
    # What a serving process opts into (app.py's launch): the GIL switch interval, and the
    # heap frozen so a full GC in a poller thread walks only what requests made (unfrozen again
    # by shutdown_engine, so the next engine's build can reclaim this one).
    tune_process()
    return llm


def shutdown_engine(llm) -> None:
    if llm is None:
        return
    import gc
    gc.unfreeze()       # build_engine froze the heap; the engine's objects must become collectable
    try:
        llm.shutdown()
    except Exception as exc:  # a failed shutdown must not hide the figures already measured
        log(f"engine shutdown raised {type(exc).__name__}: {exc}")


def sampling(**kwargs):
    from engine import SamplingParams
    return SamplingParams(**kwargs)


# ---------------------------------------------------------------- the HF peer

def _fill_random_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights, fast: normal_ on a GPU; on a CPU, tile one random pool (normal_ over 600M
    fp32 values costs ~10 s on 2 cores, and weight values do not change speed)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2:
                p.fill_(1.0)  # norm weights: keep activations in range
            elif p.device.type == "cuda":
                p.normal_(0.0, 0.02)
            else:
                if pool is None or pool.dtype != p.dtype:
                    pool = (torch.randn(1 << 20, generator=g) * 0.02).to(p.dtype)
                flat = p.view(-1)
                for i in range(0, flat.numel(), pool.numel()):
                    n = min(pool.numel(), flat.numel() - i)
                    flat[i:i + n].copy_(pool[:n])


def build_hf(name: str, device: torch.device, dtype: torch.dtype | None = None):
    """HF transformers model (sdpa attention) for a named shape, built directly on the device.
    The demo checkpoint loads its real weights; other shapes get random ones."""
    from transformers import AutoModelForCausalLM
    dtype = dtype if dtype is not None else default_dtype(device)
    log(f"building HF {name} on {device} ({dtype})")
    t0 = time.perf_counter()
    if name == "demo":
        model = AutoModelForCausalLM.from_pretrained(model_dir(name), dtype=dtype,
                                                     attn_implementation="sdpa").to(device)
    else:
        from transformers.initialization import no_init_weights
        cfg = hf_config(name)
        with torch.device(device), no_init_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model.tie_weights()  # no_init_weights skips the tie that from_config normally does
        _fill_random_(model)
    model.eval()
    # Benchmarks count a fixed number of tokens: no EOS, and pad id 0 for batched generate.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    sync(device)
    log(f"HF {name} ready in {time.perf_counter() - t0:.1f}s")
    return model


def hf_peer(rows: list[dict], bench: str, model: str, device: torch.device,
            dtype: torch.dtype | None, measure: Callable[[Any], Any],
            system: str = "hf-generate") -> Any:
    """Build the HF peer and return measure(hf_model), which adds its rows to `rows`. A failure
    in either adds an error row after the figures already there (and returns None); the model
    is freed either way."""
    hf_model = None
    try:
        hf_model = build_hf(model, device, dtype)
        return measure(hf_model)
    except Exception as exc:
        rows.append(error_row(bench, model, system, exc))
        return None
    finally:
        del hf_model
        free_memory(device)


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, device: torch.device,
                temperature: float = 0.0, streamer=None) -> int:
    """HF `model.generate` on a left-padded batch; returns generated tokens counted."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
        else dict(do_sample=False)
    out = model.generate(ids.to(device), attention_mask=mask.to(device),
                         max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                         streamer=streamer, **kw)
    return int((out.shape[1] - width) * out.shape[0])


@torch.no_grad()
def hf_generate_batch(model, requests: list[Request], device: torch.device,
                      temperature: float = 0.6) -> tuple[int, float]:
    """HF continuous batching (the engine behind `generate_batch`), one request per workload entry
    so each keeps its own max_new_tokens. Returns (generated tokens, seconds) excluding warmup."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gen = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                           eos_token_id=-1, pad_token_id=0,
                           max_new_tokens=max(r.max_tokens for r in requests))
    if device.type == "cpu":
        # HF sizes its paged cache from CUDA memory only; give the CPU smoke run a fixed budget.
        from transformers.generation.continuous_batching import cache as cb_cache
        cb_cache.PagedAttentionMemoryHandler.get_available_memory = lambda self: 1 << 30
        cb = ContinuousBatchingConfig(block_size=16, num_blocks=256, max_batch_tokens=512)
    else:
        cb = ContinuousBatchingConfig()
    with model.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb,
                                                   block=True, timeout=10) as manager:
        sync(device)
        t0 = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.max_tokens) for r in requests]
        done: dict[str, int] = {}
        while len(done) < len(ids):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"HF continuous batching failed a request: {res.error}")
                done[res.request_id] = len(res.generated_tokens)
            elif res is None and not manager.is_running():
                raise RuntimeError("HF continuous batching thread stopped early")
        sync(device)
        elapsed = time.perf_counter() - t0
    return sum(done.values()), elapsed


# ---------------------------------------------------------------- CLI

def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_SHAPES) + ["demo"])
    p.add_argument("--device", default=None, help="cuda (default if present) or cpu")
    p.add_argument("--dtype", default=None, help="bf16 on GPU, fp32 on CPU by default")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model and counts: a seconds-long smoke run (CPU friendly)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--no-floors", action="store_true", help="skip the copy/matmul floors")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    return p


def finish_cli(rows: list[dict], title: str, json_path: str | None) -> None:
    print_rows(rows, title)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


# ---------------------------------------------------------------- Triton compiles

class CompileLog:
    """Triton's JIT hooks: every kernel compiled (or loaded from the disk cache) in-process."""

    def __init__(self):
        self.entries: list[tuple[str, float]] = []
        self._started: dict[int, float] = {}
        try:
            from triton import knobs
        except ImportError:         # a Triton without knobs: nothing is logged
            return
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *args, **kw):
        self._started[id(kw.get("key"))] = time.perf_counter()
        return False                # False: go on and compile

    def _after(self, *args, **kw):
        t = self._started.pop(id(kw.get("key")), None)
        name = str(kw.get("repr") or kw.get("key")).split("[", 1)[0]
        self.entries.append((name, time.perf_counter() - t if t is not None else 0.0))
        return False

    def close(self) -> None:
        try:
            from triton import knobs
            knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
        except ImportError:
            pass
