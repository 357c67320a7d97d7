"""Synthetic EngineSnapshot / RequestTrace records and app helpers for the UI tests."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # plain `pytest` puts only tests/ on the path
    sys.path.insert(0, str(ROOT))

from engine.records import (BlockInfo, EngineSnapshot, KVLayout, RankLayout, StepEntry,
                             StepTrace)
from engine.parallel import free_port  # noqa: F401  (the tests' one free-port helper)
from engine.probes.trace import AttentionStep, LensStep, RequestTrace


def make_snapshot(rng: np.random.Generator, num_blocks: int = 12, block_size: int = 4,
                  num_steps: int = 10, moe: bool = False, tp: int = 1) -> EngineSnapshot:
    """Two requests sharing a 2-block prefix (ref 2), one evictable block, the rest free."""
    ref = np.zeros(num_blocks, np.int32)
    ref[[0, 1]] = 2                                           # shared prefix
    ref[[2, 3]] = 1                                           # req-0's partial tail, req-1's
    hashed = np.zeros(num_blocks, np.bool_)
    hashed[[0, 1, 4]] = True                                  # 4: evictable, cached but free
    steps = []
    for k in range(num_steps):
        prefill = k == 0
        entries = [StepEntry("req-0", "prefill" if prefill else "decode",
                             9 if prefill else 1, 0 if prefill else 8 + k),
                   StepEntry("req-1", "decode", 1, 4 + k)]
        steps.append(StepTrace(
            step_id=100 + k, wall_time=1000.0 + 0.1 * k, entries=entries,
            num_prefill_tokens=9 if prefill else 0, num_decode_tokens=2 - prefill,
            t_schedule=1e-4, t_prepare=2e-4, t_forward=float(rng.uniform(1e-3, 5e-3)),
            t_sample=3e-4, graph_bucket=None if prefill else 2, num_running=2, num_waiting=0,
            kv_usage=float(rng.uniform(0.2, 0.5)),
            expert_load=rng.integers(0, 5, (2, 8)) if moe else None))
    heads, kv_heads = 4, 2
    tp_layout = [RankLayout(r, list(range(r * heads // tp, (r + 1) * heads // tp)),
                            list(range(r * kv_heads // tp, (r + 1) * kv_heads // tp)),
                            None if moe else (r * 64 // tp, (r + 1) * 64 // tp),
                            (r * 16 // tp, (r + 1) * 16 // tp) if moe else None,
                            (r * 100 // tp, (r + 1) * 100 // tp), 4096)
                 for r in range(tp)]
    return EngineSnapshot(
        model_name="tiny", architecture="Qwen3ForCausalLM", num_params=12345, dtype="float32",
        device="cpu", tp_size=tp, block_size=block_size, num_blocks=num_blocks,
        block_ref=ref, block_hashed=hashed,
        block_tables={"req-0": [0, 1, 2], "req-1": [0, 1, 3]},
        request_tokens={"req-0": 3 * block_size - 1, "req-1": 2 * block_size + 1},
        running=["req-0", "req-1"], waiting=[], num_free_blocks=num_blocks - 4, usage=4 / 12,
        prefix_hits=2, prefix_queries=4, evictions=0, preemptions=0, steps=tuple(steps),
        kv_layout=KVLayout((2, 2, num_blocks, block_size, kv_heads, 8), "float32",
                           2 * 2 * block_size * kv_heads * 8 * 4, 2 * 2 * kv_heads * 8 * 4,
                           num_blocks * 2 * 2 * block_size * kv_heads * 8 * 4),
        tp_layout=tp_layout,
        moe={"num_experts": 8, "top_k": 2, "moe_layers": [0, 1]} if moe else None,
        num_layers=2, num_heads=heads, num_kv_heads=kv_heads)


def make_trace(rng: np.random.Generator, num_prompt: int = 6, num_out: int = 4,
               num_layers: int = 3, num_heads: int = 4, block_size: int = 4,
               moe_experts: int = 0) -> RequestTrace:
    """A watched request with norms, lens and attention for every generated token."""
    t = num_prompt + num_out
    tr = RequestTrace("req-0", num_layers,
                      prompt_token_ids=[int(x) for x in rng.integers(0, 100, num_prompt)],
                      output_token_ids=[int(x) for x in rng.integers(0, 100, num_out)],
                      token_texts=[f"tok{i}" for i in range(t)])
    tr.resid_norms = [rng.uniform(1, 10, num_layers + 1).astype(np.float32) for _ in range(t)]
    for pos in range(num_prompt - 1, t - 1):
        top = rng.dirichlet(np.ones(5), num_layers).astype(np.float32)
        top = -np.sort(-top, axis=1)
        tr.lens.append(LensStep(pos, int(rng.integers(100)), rng.integers(0, 100, (num_layers, 5)),
                                top, rng.integers(0, 5, num_layers), top[:, 0],
                                rng.uniform(0, 3, num_layers).astype(np.float32)))
        ctx = pos + 1
        probs = rng.dirichlet(np.ones(ctx), (num_layers, num_heads)).astype(np.float32)
        nblk = -(-ctx // block_size)
        tr.attention.append(AttentionStep(pos, list(range(num_layers)), probs,
                                          [10 + i for i in range(nblk)], block_size))
    if moe_experts:
        tr.moe_layers = list(range(num_layers))
        for _ in range(t):
            p = rng.dirichlet(np.ones(moe_experts), num_layers).astype(np.float32)
            ids = np.argsort(-p, axis=1)[:, :2]
            tr.router_probs.append(p)
            tr.router_topk_ids.append(ids)
            tr.router_topk_weights.append(np.take_along_axis(p, ids, 1))
    return tr


# ---- the app on a local port, shared by the API and browser tests ----------------------------

class RunningApp:
    """The playground launched in-process on a free port, over a small engine."""

    def __init__(self):
        import os
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        os.environ.setdefault("GRADIO_HEARTBEAT_INTERVAL", "2")   # closed tabs noticed fast
        import app
        from engine import LLM
        model, banner = app.resolve_model(None)
        # a small cache the block grid shows whole, fp32 on the CPU; GLASSBOX_TEST_KV_BLOCKS
        # measures the views over a bigger one
        blocks = int(os.environ.get("GLASSBOX_TEST_KV_BLOCKS", "160"))
        kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=blocks, block_size=16,
                      record_expert_load=True)
        self.llm = LLM(model, **kwargs)
        self.demo = app.build_app(self.llm, banner=banner, llm_kwargs=kwargs)
        self.hub = self.demo.hub
        self.port = free_port()
        app.launch(self.demo, port=self.port, prevent_thread_lock=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def close(self):
        self.demo.close()
        self.hub.shutdown()


_APP: RunningApp | None = None


def shared_app() -> RunningApp:
    """One app per test session (launching costs seconds); closed at interpreter exit."""
    global _APP
    if _APP is None:
        import atexit
        _APP = RunningApp()
        atexit.register(_APP.close)
    return _APP


def require_engine():
    """Skip (with the reason) when the engine cannot be imported yet."""
    import pytest
    try:
        from engine import LLM  # noqa: F401
    except Exception as e:      # the engine is being written alongside the UI
        pytest.skip(f"engine not importable: {e!r}")


def wait_until(pred, timeout: float = 20.0, interval: float = 0.1):
    """Poll `pred` until it returns a truthy value; that value, or AssertionError on timeout."""
    import time
    end = time.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.time() > end:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
