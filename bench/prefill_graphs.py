"""TTFT with prefill CUDA graphs (engine/prefill_graphs.py) and without, on one engine,
alternating: a max_tokens=1 request of each prompt length, fresh ids every run (no prefix hit).

    python bench/prefill_graphs.py [--model qwen3-0.6b] [--lens 128,512,1024,2048] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (MODEL_SHAPES, build_engine, log, median, random_prompt,  # noqa: E402
                    resolve_device, sampling, shutdown_engine)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    dev = resolve_device(None)
    lens = [int(x) for x in a.lens.split(",")]
    t0 = time.perf_counter()
    llm = build_engine(a.model, dev, max_model_len=4096)
    log(f"built (graphs included) in {time.perf_counter() - t0:.1f}s")
    id_high = min(10_000, llm.hf_config.vocab_size)
    graphs = llm.runner.prefill_graphs
    res: dict = {"model": a.model, "device": str(dev), "buckets": graphs.buckets if graphs else []}
    one = sampling(temperature=0.0, ignore_eos=True, max_tokens=1)
    try:
        for n in lens:                      # warm-up both ways (compiles the eager shapes)
            for g in (graphs, None):
                llm.runner.prefill_graphs = g
                llm.generate([random_prompt(n, id_high, 7_000 + n)], one)
        for n in lens:
            t = {"graphs": [], "eager": []}
            for r in range(a.repeats):
                for name, g in (("graphs", graphs), ("eager", None)):
                    llm.runner.prefill_graphs = g
                    p = random_prompt(n, id_high, 10_000 * (name == "eager") + 100 * r + n)
                    if dev.type == "cuda":
                        import torch
                        torch.cuda.synchronize()
                    s = time.perf_counter()
                    llm.generate([p], one)
                    t[name].append(1e3 * (time.perf_counter() - s))
            st = llm.inspect().steps[-1]
            res[f"ttft_ms_{n}"] = {k: median(v) for k, v in t.items()}
            log(f"{n} tokens: graphs {median(t['graphs']):.2f} ms, eager {median(t['eager']):.2f}"
                f" ms (last step bucket {st.graph_bucket}, forward {1e3 * st.t_forward:.2f} ms)")
    finally:
        llm.runner.prefill_graphs = graphs
        shutdown_engine(llm)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
