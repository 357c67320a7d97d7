"""The HTTP side of bench/serve.py: fire a workload at an OpenAI-compatible /v1/completions
with streaming, all requests at once (or one after another for TTFT), and report per-request
TTFT, output tokens and the wall time. Runs in its own process so its parsing never competes
with the server for the GIL; imports only httpx (no torch), so it starts in a blink.

    python bench/serve_client.py URL REQUESTS.json OUT.json [--sequential] [--api-key KEY]
REQUESTS.json: [{"prompt": [ids], "max_tokens": n}, ...]; temperature / ignore_eos in "sampling".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time


async def one(client, url: str, body: dict) -> dict:
    """One streamed completion: TTFT (first chunk with a choice), output tokens (usage)."""
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            if ttft is None and '"choices":[{' in data:
                ttft = time.perf_counter() - t0
            elif '"error":' in data and '"choices"' not in data:
                raise RuntimeError(f"stream error: {data[:300]}")
            elif '"usage":{' in data:
                usage = json.loads(data)["usage"]
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {"ttft_s": ttft, "output_tokens": usage["completion_tokens"],
            "prompt_tokens": usage["prompt_tokens"], "latency_s": time.perf_counter() - t0}


async def run(url: str, requests: list[dict], sampling: dict, model: str, sequential: bool,
              api_key: str | None) -> dict:
    import httpx
    n = max(1, len(requests))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    bodies = [{"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"],
               "stream": True, "stream_options": {"include_usage": True}, **sampling}
              for r in requests]
    endpoint = url.rstrip("/") + "/v1/completions"
    async with httpx.AsyncClient(limits=limits, timeout=None, headers=headers) as client:
        await client.get(url.rstrip("/") + "/v1/models")      # connect once before the clock
        t0 = time.perf_counter()
        if sequential:
            results = [await one(client, endpoint, b) for b in bodies]
        else:
            results = await asyncio.gather(*(one(client, endpoint, b) for b in bodies))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": results}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("requests")
    p.add_argument("out")
    p.add_argument("--sequential", action="store_true", help="one request at a time (TTFT)")
    p.add_argument("--api-key")
    a = p.parse_args(argv)
    spec = json.loads(open(a.requests).read())
    out = asyncio.run(run(a.url, spec["requests"], spec.get("sampling", {}), spec["model"],
                          a.sequential, a.api_key))
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
