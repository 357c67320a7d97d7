"""Is a process's first timed run slower than its later ones, and why? The throughput workload
run `--repeats` times in one process, each repeat split by the engine's own step traces (device
time of decode and mixed steps, host schedule / prepare / launch / wait / postprocess) beside
what else can make a first run slow: Triton compiling inside it (its compile hooks), GC, page
faults, the caching allocator, the GPU's clocks.

    python bench/diagnostics/first_run.py [--model qwen3-30b-a3b] [--repeats 3] [--no-gc]
    TRITON_CACHE_DIR=$(mktemp -d) python bench/diagnostics/first_run.py    # as a fresh machine compiles

It found the dip of 2026-12-03 (bench/RESULTS.md, fifth session): 5 / 10 Triton compiles inside
the first run (1.8 s at Qwen3-0.6B, 4.8 s at Qwen3-30B-A3B), fixed by engine/kernels/jit_keys.py
and the bench warm-up. A diagnostic: it prints what it saw and asserts nothing.
"""
from __future__ import annotations

import gc
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (TINY_OF, CompileLog, base_parser, build_engine, finish_cli, log,
                          make_workload, resolve_device, row, sampling, shutdown_engine, sync)
from bench.throughput import warmup_glassbox, workload_kwargs


class GCClock:
    def __init__(self):
        self.count, self.seconds, self._t = 0, 0.0, 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


class Clocks(threading.Thread):
    """nvidia-smi every 0.25 s: SM / memory clocks, power, temperature, throttle reasons."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[str] = []
        self.stop = threading.Event()

    def run(self):
        query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
        while not self.stop.is_set():
            try:
                self.samples.append(subprocess.run(
                    ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5).stdout.strip())
            except (OSError, subprocess.SubprocessError) as e:
                self.samples.append(type(e).__name__)
                return
            self.stop.wait(0.25)


def _mean_ms(steps, field) -> float:
    return 1e3 * sum(getattr(s, field) for s in steps) / max(1, len(steps))


def main(model: str = "qwen3-0.6b", device: str | None = None, num_requests: int = 256,
         repeats: int = 3, tiny: bool = False, no_gc: bool = False) -> list[dict]:
    dev = resolve_device(device)
    if tiny:
        model = TINY_OF.get(model, model)
    compiles, gclock = CompileLog(), GCClock()
    clocks = Clocks() if dev.type == "cuda" else None
    rows: list[dict] = []
    llm = build_engine(model, dev, max_model_len=256 if tiny else 4096, trace_history=20000)
    try:
        log(f"Triton compiles while building: {len(compiles.entries)}")
        warmup_glassbox(llm, model, tiny, dev)
        log(f"... and after the warm-up: {len(compiles.entries)}")
        if clocks is not None:
            clocks.start()
        kw = workload_kwargs(model, tiny)
        for r in range(repeats):
            reqs = make_workload(num_requests, seed=0, id_stream=r, **kw)
            params = [sampling(temperature=0.6, ignore_eos=True, max_tokens=q.max_tokens)
                      for q in reqs]
            c0, n0 = llm.core.steps.count, len(compiles.entries)
            g0 = (gclock.count, gclock.seconds)
            k0 = len(clocks.samples) if clocks is not None else 0
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            if no_gc:
                gc.disable()
            sync(dev)
            t0 = time.perf_counter()
            outs = llm.generate([q.prompt for q in reqs], params)
            sync(dev)
            secs = time.perf_counter() - t0
            if no_gc:
                gc.enable()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            steps, _ = llm.core.steps.since(c0)
            tokens = sum(len(o.token_ids) for o in outs)
            new = compiles.entries[n0:]
            note = f"repeat {r}"
            log(f"repeat {r}: {tokens} tokens in {secs:.2f}s = {tokens / secs:,.0f} tok/s, "
                f"{len(steps)} steps; {len(new)} Triton compiles ({sum(t for _, t in new):.2f}s)")
            rows += [row("first_run", model, "glassbox", "output_tok_s", tokens / secs, "tok/s", note),
                     row("first_run", model, "glassbox", "triton_compiles", len(new), "", note),
                     row("first_run", model, "glassbox", "triton_compile_s",
                         sum(t for _, t in new), "s", note)]
            for name, t in new:
                log(f"    compiled {name} ({t * 1e3:.0f} ms)")
            for kind, xs in (("decode", [s for s in steps if s.num_prefill_tokens == 0]),
                             ("mixed", [s for s in steps if s.num_prefill_tokens > 0])):
                if not xs:
                    continue
                log(f"  {len(xs)} {kind} steps, ms each: device {_mean_ms(xs, 't_forward'):.3f}, "
                    f"schedule {_mean_ms(xs, 't_schedule'):.3f}, prepare {_mean_ms(xs, 't_prepare'):.3f}, "
                    f"launch {_mean_ms(xs, 't_launch'):.3f}, wait {_mean_ms(xs, 't_wait'):.3f}, "
                    f"postprocess {_mean_ms(xs, 't_sample'):.3f}")
                rows.append(row("first_run", model, "glassbox", f"{kind}_step_ms",
                                _mean_ms(xs, "t_forward"), "ms", f"{note}, device time, {len(xs)} steps"))
            log(f"  process CPU {ru1.ru_utime - ru0.ru_utime:.2f}s user, "
                f"{ru1.ru_stime - ru0.ru_stime:.2f}s sys; page faults {ru1.ru_minflt - ru0.ru_minflt}; "
                f"GC {gclock.count - g0[0]} collections, {gclock.seconds - g0[1]:.3f}s")
            if dev.type == "cuda":
                import torch
                st = torch.cuda.memory_stats()
                log(f"  allocator: {st.get('num_alloc_retries', 0)} retries, "
                    f"{st.get('num_device_alloc', 0)} device allocations so far")
            if clocks is not None and len(clocks.samples) > k0:
                s = clocks.samples[k0:]
                log(f"  clocks (SM, memory MHz, W, C, throttle) first / middle / last: "
                    f"{s[0]} | {s[len(s) // 2]} | {s[-1]}")
    finally:
        if clocks is not None:
            clocks.stop.set()
        compiles.close()
        gclock.close()
        shutdown_engine(llm)
    return rows


if __name__ == "__main__":
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-gc", action="store_true", help="the collector off during each repeat")
    a = p.parse_args()
    finish_cli(main(a.model, a.device, 8 if a.tiny else a.num_requests, a.repeats, a.tiny,
                    a.no_gc), "first run vs later runs", a.json)
