"""Where a step's time goes, on the GPU: per-kernel CUDA time of one batch-1 decode step and of a
full-batch decode step (torch profiler), and, for the `throughput` workload, the engine's own
StepTraces grouped by step kind (graph-replayed decode, eager decode, mixed, prefill-only).
`--probes-only`: batch-1 decode with each probe set watched; `--verify`: plain decode steps
against speculative verify steps.

    python bench/diagnostics/step_profile.py [--model qwen3-0.6b] [--num-requests 256]

A diagnostic, not a benchmark: it prints tables, it does not write RESULTS.md.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.common import (base_parser, build_engine, make_workload, random_prompt, resolve_device,
                          sampling, shutdown_engine, TINY_OF)
from bench.throughput import run_glassbox, warmup_glassbox, workload_kwargs


def cuda_kernel_rows(prof) -> list[tuple[float, int, str]]:
    """(CUDA µs, launches, kernel name) of every kernel the profiler saw, largest first."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.device_type == torch.autograd.DeviceType.CUDA and dev_us > 0:
            rows.append((dev_us, e.count, e.key))
    return sorted(rows, reverse=True)


def kernel_table(llm, prompts: list[list[int]], new_tokens: int, top: int = 25,
                 temperature: float = 0.0, watch=None) -> None:
    """Profile decoding `new_tokens` for these prompts; print CUDA time per kernel per step,
    and the wall time per step of the same run without the profiler."""
    from torch.profiler import ProfilerActivity, profile
    params = sampling(temperature=temperature, ignore_eos=True, max_tokens=new_tokens)
    w = [watch] + [None] * (len(prompts) - 1) if watch is not None else None
    llm.generate(prompts, params, watch=w)              # warm every graph bucket used
    n0 = llm.core.step_id
    t0 = time.perf_counter()
    with host_timers(llm) as timers:
        llm.generate(prompts, params, watch=w)
    plain = (time.perf_counter() - t0) / max(llm.core.step_id - n0, 1)
    fresh = [llm.core.steps[i] for i in range(-min(new_tokens - 1, 8), 0)]
    host = sum(s.t_schedule + s.t_prepare + s.t_forward for s in fresh) / len(fresh)
    n0 = llm.core.step_id
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, watch=w)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = max(llm.core.step_id - n0, 1)
    rows = cuda_kernel_rows(prof)
    total = sum(r[0] for r in rows)
    print(f"\n== batch {len(prompts)}, T={temperature}, {steps} steps ({new_tokens} tokens incl. "
          f"prefill step): no profiler {1e3 * plain:.3f} ms/step (last decode steps: host "
          f"sched+prep+launch {1e3 * host:.3f} ms); profiled {1e3 * wall / steps:.3f} ms/step, "
          f"CUDA kernels {total / steps / 1e3:.3f} ms/step, "
          f"{sum(r[1] for r in rows) / steps:.0f} kernels/step, watch={watch}")
    n = max(new_tokens, 1)
    print("host ms/step by phase (no profiler): " +
          ", ".join(f"{k} {1e3 * v / n:.3f}" for k, v in sorted(timers.items())))
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for us, cnt, key in rows[:top]:
        print(f"{us / steps:9.1f} {cnt / steps:10.1f}  {key[:110]}")


def verify_table(llm, model: str, tiny: bool, top: int = 25) -> None:
    """Per-kernel CUDA time per step of batch-1 plain decoding and of speculative verify steps
    (bench/spec_decode.py's oracle at 100 % acceptance, k = 4): which kernels a verify's extra
    rows cost."""
    from torch.profiler import ProfilerActivity, profile
    from bench.common import vocab_size
    from bench.spec_decode import FULL, TINY, oracle_run, timed_stream
    shape = TINY if tiny else FULL
    P, N, vocab = shape["prompt_len"], shape["new_tokens"], vocab_size(model)
    prompt = random_prompt(P, min(10000, vocab), 5)
    timed_stream(llm, random_prompt(P, min(10000, vocab), 999), 8, 0)      # warm-up
    settled = oracle_run(llm, prompt, timed_stream(llm, prompt, N, 0)["tokens"], P, N, 1.0,
                         vocab, 0)["tokens"]
    for name, run in (("plain", lambda: timed_stream(llm, prompt, N, 0)),
                      ("verify (oracle 100 %)",
                       lambda: oracle_run(llm, prompt, settled, P, N, 1.0, vocab, 0))):
        _, cursor = llm.steps_since(0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            r = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        steps, _ = llm.steps_since(cursor)
        n = max(len(steps), 1)
        rows = cuda_kernel_rows(prof)
        print(f"\n== {name}: {r['tok_s']:,.0f} tok/s, {n} steps (graph buckets "
              f"{sorted({s.graph_bucket for s in steps}, key=str)}); CUDA kernels "
              f"{sum(x[0] for x in rows) / n / 1e3:.3f} ms a step, "
              f"{sum(x[1] for x in rows) / n:.0f} launches a step")
        for us, cnt, key in rows[:top]:
            print(f"{us / n:9.1f} {cnt / n:7.1f}  {key[:110]}")


def prefill_table(llm, prompt: list[int], id_high: int, top: int = 20) -> None:
    """TTFT of one prompt (max_tokens=1): wall time without and with the profiler, the CUDA
    time and launch count of its kernels, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile
    params = sampling(temperature=0.0, max_tokens=1)
    llm.generate([prompt[::-1]], params)                 # warm: compile the prefill shapes
    walls = []
    for i in range(5):
        p = [(t + 7 * (i + 1)) % id_high for t in prompt]  # fresh ids: no prefix-cache hit
        t0 = time.perf_counter()
        llm.generate([p], params)
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([[(t + 3) % id_high for t in prompt]], params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = cuda_kernel_rows(prof)
    st = llm.core.steps[-1]
    print(f"\n== TTFT, {len(prompt)}-token prompt: wall {1e3 * sorted(walls)[2]:.2f} ms (median "
          f"of 5); CUDA kernels {sum(r[0] for r in rows) / 1e3:.2f} ms in "
          f"{sum(r[1] for r in rows)} launches; last step: schedule {1e3 * st.t_schedule:.2f}, "
          f"prepare {1e3 * st.t_prepare:.2f}, launch {1e3 * st.t_launch:.2f}, wait "
          f"{1e3 * st.t_wait:.2f}, device {1e3 * st.t_forward:.2f}, post {1e3 * st.t_sample:.2f} ms")
    for us, cnt, key in rows[:top]:
        print(f"{us:9.1f} {cnt:6d}  {key[:110]}")


@contextmanager
def host_timers(llm):
    """Wall time spent in the engine step's phases (and the probes' host work), summed."""
    timers: dict[str, float] = defaultdict(float)
    targets = [(llm.core, "_prepare"), (llm.runner, "execute_step"), (llm.probes, "plan"),
               (llm.probes, "fold"), (llm.core, "_postprocess"), (llm.core, "_record")]
    saved = []
    for obj, name in targets:
        fn = getattr(obj, name)
        saved.append((obj, name))

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                timers[_name] += time.perf_counter() - t
        setattr(obj, name, timed)
    try:
        yield timers
    finally:
        for obj, name in saved:
            delattr(obj, name)          # back to the class attribute


def step_kinds(llm, model: str, num_requests: int, tiny: bool = False) -> None:
    """Run the throughput workload; group the engine's StepTraces by kind."""
    kw = workload_kwargs(model, tiny)
    reqs = make_workload(num_requests, seed=0, id_stream=77, **kw)
    n0 = llm.core.step_id
    tok_s, tokens, secs = run_glassbox(llm, reqs, llm.runner.device)
    steps = [s for s in llm.core.steps if s.step_id >= n0]
    print(f"\n== throughput workload: {num_requests} requests, {tokens} tokens in {secs:.2f}s = "
          f"{tok_s:,.0f} tok/s, {llm.core.step_id - n0} steps ({len(steps)} traced)")
    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0])
    for s in steps:
        if s.num_prefill_tokens and s.num_decode_tokens:
            kind = "mixed"
        elif s.num_prefill_tokens:
            kind = "prefill"
        else:
            kind = "decode-graph" if s.graph_bucket is not None else "decode-eager"
        a = agg[kind]
        a[0] += 1
        a[1] += s.t_schedule
        a[2] += s.t_prepare
        a[3] += s.t_forward
        a[4] += s.t_sample
        a[5] += s.t_schedule + s.t_prepare + s.t_forward + s.t_sample
        a[6] += s.num_prefill_tokens
        a[7] += s.num_decode_tokens
        a[8] += s.t_launch
        a[9] += s.t_wait
    # fwd: device time of forward + sampling (CUDA events); launch/wait: host time staging and
    # launching / blocked on the device; post: postprocessing. With overlap the host parts of
    # step N+1 run while step N is on the device, so they do not add up to the step's wall time.
    print(f"{'kind':>13} {'steps':>6} {'fwd s':>8} {'fwd ms':>8} {'sched':>7} {'prep':>7} "
          f"{'launch':>7} {'wait':>7} {'post':>7} {'prefill tok':>11} {'decode tok':>10}")
    for kind, a in sorted(agg.items(), key=lambda kv: -kv[1][3]):
        n = a[0]
        print(f"{kind:>13} {n:6d} {a[3]:8.2f} {1e3 * a[3] / n:8.2f} {1e3 * a[1] / n:7.2f} "
              f"{1e3 * a[2] / n:7.2f} {1e3 * a[8] / n:7.2f} {1e3 * a[9] / n:7.2f} "
              f"{1e3 * a[4] / n:7.2f} {a[6]:11d} {a[7]:10d}")
    buckets = defaultdict(int)
    for s in steps:
        if s.graph_bucket is not None:
            buckets[s.graph_bucket] += 1
    print("graph buckets replayed:", dict(sorted(buckets.items())))


def main(argv=None) -> None:
    p = base_parser(__doc__)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--probes-only", action="store_true",
                   help="batch-1 decode with each probe spec watched, nothing else")
    p.add_argument("--ttft", action="store_true", help="the 1,024-token prefill only")
    p.add_argument("--verify", action="store_true",
                   help="batch-1 plain decode steps against speculative verify steps only")
    a = p.parse_args(argv)
    dev = resolve_device(a.device)
    model = TINY_OF.get(a.model, a.model) if a.tiny else a.model
    n_req, plen = (8, 32) if a.tiny else (a.num_requests, 512)
    llm = build_engine(model, dev, None, max_model_len=256 if a.tiny else 4096,
                       trace_history=100_000)
    try:
        warmup_glassbox(llm, model, a.tiny, dev)
        id_high = workload_kwargs(model, a.tiny)["id_high"]
        if a.ttft:
            prefill_table(llm, random_prompt(32 if a.tiny else 1024, id_high, 5), id_high)
            return
        if a.verify:
            verify_table(llm, model, a.tiny)
            return
        if a.probes_only:
            from bench.probes import probe_specs
            kernel_table(llm, [random_prompt(plen // 2, id_high, 1)], 64)
            for name, spec in probe_specs().items():
                kernel_table(llm, [random_prompt(plen // 2, id_high, 2)], 64, watch=spec)
            return
        kernel_table(llm, [random_prompt(plen, id_high, 1)], 32)
        kernel_table(llm, [random_prompt(plen, id_high, 100 + i) for i in range(64)], 16, top=15)
        kernel_table(llm, [random_prompt(2 * plen, id_high, 300 + i) for i in range(128)], 16,
                     top=20, temperature=0.6)
        step_kinds(llm, model, n_req, a.tiny)
    finally:
        shutdown_engine(llm)


if __name__ == "__main__":
    main()
