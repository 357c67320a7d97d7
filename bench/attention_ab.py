"""The throughput workload with the decode-attention launch choices of 2026-12-02, -03 and
today's: engines built in turn (CUDA graphs capture the config), each in every round, a warm
run before each timed one. A diagnostic for bench/RESULTS.md, not part of run_all.

    python bench/attention_ab.py [--tiny]
"""
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import build_engine, make_workload, resolve_device, shutdown_engine, free_memory
from bench.throughput import run_glassbox, warmup_glassbox, workload_kwargs
from engine.kernels import decode_attention as DA


def main(tiny: bool = False, rounds: int = 2) -> dict[str, list[float]]:
    model = "tiny" if tiny else "qwen3-0.6b"
    dev = resolve_device("cpu" if tiny else None)
    # (direct-path launch, DIRECT_WIDE_PROGRAMS, WIDE_FROM_PROGRAMS) of each day's choice
    configs = {"2026-12-02 (n64 st2)": (dict(BLOCK_N=64, num_warps=4, num_stages=2), 1 << 62, 1 << 62),
               "2026-12-03 (st3, n128 past 1024)": (dict(BLOCK_N=64, num_warps=4, num_stages=3), 1024, 1 << 62),
               "2026-12-04 (one wave and n128 from 128)": (dict(DA.DIRECT_LAUNCH), DA.DIRECT_WIDE_PROGRAMS,
                                                           DA.WIDE_FROM_PROGRAMS)}
    keep = dict(DA.DIRECT_LAUNCH), DA.DIRECT_WIDE_PROGRAMS, DA.WIDE_FROM_PROGRAMS
    n = 8 if tiny else 256
    res: dict[str, list[float]] = {k: [] for k in configs}
    try:
        for rnd in range(rounds):
            for name, (launch, wide, wide_from) in configs.items():
                DA.DIRECT_LAUNCH.clear()
                DA.DIRECT_LAUNCH.update(launch)
                DA.DIRECT_WIDE_PROGRAMS, DA.WIDE_FROM_PROGRAMS = wide, wide_from
                llm = build_engine(model, dev, None, max_model_len=256 if tiny else 4096)
                try:
                    warmup_glassbox(llm, model, tiny, dev)
                    kw = workload_kwargs(model, tiny)
                    run_glassbox(llm, make_workload(n, seed=0, id_stream=600 + rnd, **kw), dev)
                    tps, tokens, secs = run_glassbox(
                        llm, make_workload(n, seed=0, id_stream=500 + rnd, **kw), dev)
                finally:
                    shutdown_engine(llm)
                    llm = None
                    free_memory(dev)
                res[name].append(tps)
                print(f"round {rnd} {name}: {tps:,.0f} tok/s ({tokens} tokens, {secs:.2f} s)",
                      flush=True)
    finally:
        DA.DIRECT_LAUNCH.clear()
        DA.DIRECT_LAUNCH.update(keep[0])
        DA.DIRECT_WIDE_PROGRAMS, DA.WIDE_FROM_PROGRAMS = keep[1], keep[2]
    for name, xs in res.items():
        print(f"{name}: {', '.join(f'{x:,.0f}' for x in xs)} tok/s, mean {sum(xs) / len(xs):,.0f}")
    return res


if __name__ == "__main__":
    main(tiny="--tiny" in sys.argv)
