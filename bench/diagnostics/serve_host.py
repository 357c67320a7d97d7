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
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.serve import client_cmd
from engine.sequence import TokenEvent


class FakeLLM:
    """The part of LLM the API uses: submit / stream / abort, one token per request per step."""
    model_name = model_path = "fake"
    max_model_len = 1 << 20
    tokenizer = None

    def __init__(self, busy_ms: float, wait_ms: float):
        self.busy_s, self.wait_s = busy_ms / 1e3, wait_ms / 1e3
        self._lock = threading.Lock()
        self._reqs: dict[str, list] = {}            # id -> [tokens so far, max_tokens, sink]
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
                reqs = list(self._reqs.items())
            for rid, r in reqs:
                r[0] += 1
                done = r[0] >= r[1]
                r[2](TokenEvent(rid, 5, "", "", done, "length" if done else None, None,
                                {"num_prompt_tokens": 3, "num_output_tokens": r[0]}))
                self.tokens += 1
                if done:
                    with self._lock:
                        self._reqs.pop(rid, None)
            self.steps += 1

    def encode(self, prompt) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else [5, 5, 5]

    def submit(self, prompt, sampling=None, watch=None, request_id=None, *, on_event) -> str:
        with self._lock:
            self._reqs[request_id] = [0, sampling.max_tokens, on_event]
        return request_id

    def stream(self, prompt, sampling=None, watch=None, request_id=None):
        q: queue.Queue = queue.Queue()
        self.submit(prompt, sampling, watch, request_id, on_event=q.put)
        while True:
            ev = q.get()
            yield ev
            if ev.finished:
                return

    def abort(self, request_id: str) -> bool:
        with self._lock:
            return self._reqs.pop(request_id, None) is not None

    def close(self) -> None:
        self._stop = True


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--busy-ms", type=float, default=1.0)
    p.add_argument("--wait-ms", type=float, default=3.0)
    a = p.parse_args(argv)
    from api.server import BackgroundServer, create_app
    llm = FakeLLM(a.busy_ms, a.wait_ms)
    server = BackgroundServer(create_app(llm))
    try:
        time.sleep(1.0)
        s0, t0 = llm.steps, time.perf_counter()
        time.sleep(3.0)
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
    finally:
        llm.close()
        server.stop()
    res = {"alone_steps_s": alone, "served_steps_s": steps / wall,
           "fewer_steps_pct": 100 * (1 - steps / wall / alone), "tok_s": tokens / wall,
           "server_us_per_token": 1e6 * (cpu - steps * a.busy_ms / 1e3) / max(tokens, 1)}
    print(f"{a.streams} streams x {a.max_tokens} tokens: engine alone {alone:.0f} steps/s, "
          f"while serving {res['served_steps_s']:.0f} ({res['fewer_steps_pct']:.1f} % fewer); "
          f"{res['tok_s']:,.0f} tok/s; server CPU beyond the engine's busy loop "
          f"{res['server_us_per_token']:.1f} µs/token")
    return res


if __name__ == "__main__":
    main()
