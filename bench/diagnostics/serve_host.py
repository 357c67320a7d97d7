"""The API's host cost without a GPU: a fake engine whose step holds the GIL for --busy-ms of
Python (a real step's host work) and releases it for --wait-ms (the GPU's share), served through
the real API routes to bench/serve.py's client in another process. The engine's steps per second
with the clients streaming, against the engine alone, is the share of the GIL the server takes;
also reported: the server process's CPU time per token beyond the engine's own.

    python bench/diagnostics/serve_host.py --streams 64 --max-tokens 600

This models the mechanism behind bench/serve.py's GPU overhead (on a 2-core machine the
client process also competes for the cores, so read differences between versions, not absolute
figures). Measured on the 2-core CI machine, 2026-12-01, 64 streams x 600 tokens: a thread
per request (tree 35c751a) 20-33 % fewer engine steps and ~100 µs of server CPU per token;
events from the engine thread with paced wake-ups (11ebef4) 11-13 % and 30-40 µs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.serve import client_cmd
from engine.interventions.spec import ModelFacts
from engine.processor import EngineRequest, ModelLimits, Processor
from engine.sequence import TokenEvent


class FakeLLM:
    """An EngineClient (engine/client.py) without a model: the real processor checks each
    request as the engine's does, and one engine thread steps every running request by a
    token per step, calling the listeners and sinks under its lock as engine/engine_loop.py
    does, so the server's per-token work is the real one. Token-id prompts only (no tokenizer),
    which is what bench/serve.py's client sends."""
    hf_config = SimpleNamespace(architectures=["FakeForCausalLM"], vocab_size=1024,
                                num_hidden_layers=1, num_attention_heads=1, hidden_size=1)
    model_name, model_path, architecture = "fake", None, hf_config.architectures[0]
    num_params, device, dtype, dtype_name, tp_size = 0, "cpu", torch.float32, "float32", 1
    max_model_len, block_size = 1 << 20, 16
    num_kv_blocks = max_model_len // block_size
    tokenizer = None
    eos_token_ids: set[int] = set()
    moe_layers: tuple[int, ...] = ()

    def __init__(self, busy_ms: float, wait_ms: float):
        self.busy_s, self.wait_s = busy_ms / 1e3, wait_ms / 1e3
        self.intervention_facts = ModelFacts.of(self.hf_config, self.moe_layers,
                                                self.max_model_len)
        self.processor = Processor(self.tokenizer, self.eos_token_ids, ModelLimits(
            self.hf_config.vocab_size, self.hf_config.num_hidden_layers, self.max_model_len,
            self.num_kv_blocks, self.block_size), self.intervention_facts)
        self.finish_listeners: list = []
        self.step_listeners: list = []
        self.errors: list[Exception] = []       # what the server's callbacks raised
        self._lock = threading.Lock()
        self._reqs: dict[str, list] = {}        # id -> [EngineRequest, sink, tokens so far]
        self.steps = self.tokens = 0
        self._stop = False
        threading.Thread(target=self._loop, daemon=True, name="fake-engine").start()

    def _loop(self) -> None:
        while not self._stop:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < self.busy_s:     # host work: the GIL held
                pass
            time.sleep(self.wait_s)                             # the device: the GIL released
            with self._lock:
                running = list(self._reqs.values())
                for r in running:
                    r[2] += 1
                    req, n = r[0], r[2]
                    done = n >= req.params.max_tokens
                    self._deliver(TokenEvent(req.request_id, 5, "", "", done,
                                             "length" if done else None, None,
                                             self._metrics(req, n) if done else None))
                if running:
                    for listener in self.step_listeners:
                        self._call(listener, len(running))
                self.tokens += len(running)
            self.steps += 1

    @staticmethod
    def _metrics(req: EngineRequest, n: int) -> dict:
        return {"num_prompt_tokens": len(req.prompt), "num_output_tokens": n}

    def _deliver(self, ev: TokenEvent) -> None:
        """The caller holds the lock."""
        sink = self._reqs[ev.request_id][1]
        if ev.finished:
            del self._reqs[ev.request_id]
            for listener in self.finish_listeners:
                self._call(listener, ev)
        self._call(sink, ev)

    def _call(self, f, item) -> None:
        # the engine loop's rule: a consumer's bug must not stop the steps (the other streams
        # would hang); main() fails on it after the run instead
        try:
            f(item)
        except Exception as e:  # noqa: BLE001
            self.errors.append(e)

    def submit(self, prompt, sampling=None, watch=None, request_id=None, *, on_event,
               interventions=None, cache_salt=None) -> str:
        req = prompt if isinstance(prompt, EngineRequest) else self.processor.process(
            prompt, sampling, watch=watch, request_id=request_id, interventions=interventions,
            cache_salt=cache_salt)
        with self._lock:
            self._reqs[req.request_id] = [req, on_event, 0]
        return req.request_id

    def abort(self, request_id: str) -> bool:
        with self._lock:
            r = self._reqs.get(request_id)
            if r is not None:
                self._deliver(TokenEvent(request_id, None, "", "", True, "abort", None,
                                         self._metrics(r[0], r[2])))
            return r is not None

    def annotate(self, request_id: str, note: str) -> bool:
        with self._lock:
            return request_id in self._reqs

    def stats(self) -> dict:
        with self._lock:
            running = len(self._reqs)
        return {"num_running": running, "num_waiting": 0, "kv_usage": 0.0, "prefix_hits": 0,
                "prefix_queries": 0, "num_preemptions": 0, "block_size": self.block_size,
                "alive": not self._stop}

    def trace(self, request_id: str):
        raise KeyError(f"no trace of {request_id!r}: the fake engine watches nothing")

    def traced_requests(self) -> list[str]:
        return []

    def _not_served(self, *args, **kwargs):
        raise NotImplementedError("the fake engine serves the API's requests only: no "
                                  "in-process generation, no glass")

    stream = generate = inspect = steps_since = block_info = read_kv_block = read_kv_bytes = \
        model_parts = steering_vector = _not_served

    def shutdown(self) -> None:
        self._stop = True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--busy-ms", type=float, default=1.0)
    p.add_argument("--wait-ms", type=float, default=3.0)
    p.add_argument("--alone-s", type=float, default=3.0,
                   help="seconds the engine steps alone, for the baseline")
    a = p.parse_args(argv)
    from api.server import BackgroundServer, create_app
    llm = FakeLLM(a.busy_ms, a.wait_ms)
    server = BackgroundServer(create_app(llm))
    try:
        time.sleep(1.0)
        s0, t0 = llm.steps, time.perf_counter()
        time.sleep(a.alone_s)
        alone = (llm.steps - s0) / (time.perf_counter() - t0)
        with tempfile.TemporaryDirectory(prefix="glassbox-serve-host-") as tmp:
            spec, out = Path(tmp) / "requests.json", Path(tmp) / "out.json"
            spec.write_text(json.dumps({
                "model": "fake", "sampling": {"temperature": 0.0, "ignore_eos": True},
                "requests": [{"prompt": [1, 2, 3], "max_tokens": a.max_tokens}] * a.streams}))
            s0, k0, c0, t0 = llm.steps, llm.tokens, time.process_time(), time.perf_counter()
            subprocess.run(client_cmd(server.url, spec, out), check=True, timeout=600)
            wall = time.perf_counter() - t0
            steps, tokens, cpu = llm.steps - s0, llm.tokens - k0, time.process_time() - c0
            streamed = sum(r["output_tokens"] for r in json.loads(out.read_text())["results"])
    finally:
        llm.shutdown()
        server.stop()
    if llm.errors:
        raise RuntimeError(f"{len(llm.errors)} server callbacks raised on the engine thread, "
                           f"the first: {llm.errors[0]!r}") from llm.errors[0]
    res = {"alone_steps_s": alone, "served_steps_s": steps / wall,
           "fewer_steps_pct": 100 * (1 - steps / wall / alone), "tok_s": tokens / wall,
           "server_us_per_token": 1e6 * (cpu - steps * a.busy_ms / 1e3) / max(tokens, 1),
           "streamed_tokens": streamed}
    print(f"{a.streams} streams x {a.max_tokens} tokens: engine alone {alone:.0f} steps/s, "
          f"while serving {res['served_steps_s']:.0f} ({res['fewer_steps_pct']:.1f} % fewer); "
          f"{res['tok_s']:,.0f} tok/s; server CPU beyond the engine's busy loop "
          f"{res['server_us_per_token']:.1f} µs/token")
    return res


if __name__ == "__main__":
    main()
