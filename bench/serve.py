"""The OpenAI-compatible API over HTTP vs `LLM.generate` in-process, same engine, same workload:
the server's overhead in % of output throughput and in ms of TTFT (BENCH.md `serve`).

One process holds the engine and serves the API (uvicorn, the API routes only: no Gradio) from
a thread, as `python app.py` does; the HTTP client is this script in another process, so its
parsing does not compete with the server for the GIL:
    python bench/serve.py client URL REQUESTS.json OUT.json [--sequential] [--api-key KEY]
fires REQUESTS.json ({"model", "sampling", "requests": [{"prompt": [ids], "max_tokens": n}]}) at
URL's /v1/completions with streaming, all at once (--sequential: one after another) and writes
each request's TTFT and output tokens and the wall time to OUT.json. Repeats alternate the two
paths and use fresh token ids each time (no prefix-cache hits across runs).

- throughput: every request of the workload at once; output tok/s over wall time.
- TTFT: one request at a time on an idle engine, max_tokens=1: in-process, `llm.stream` call ->
  first event; over HTTP, request sent -> first SSE chunk with a token. Overhead = the medians'
  difference. (The workload's median TTFT under load is reported too; it is mostly queueing.)

GPU: the nano-vllm workload (256 requests, Qwen3-0.6B shapes, dummy weights). CPU: the demo
checkpoint and a small workload. Needs fastapi, uvicorn and httpx (imported only here).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ---------------------------------------------------------------- the HTTP client (its own process)

async def _one(client, url: str, body: dict) -> dict:
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


async def client_run(url: str, requests: list[dict], sampling: dict, model: str,
                     sequential: bool, api_key: str | None) -> dict:
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
            results = [await _one(client, endpoint, b) for b in bodies]
        else:
            results = await asyncio.gather(*(_one(client, endpoint, b) for b in bodies))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "results": results}


def client_cmd(url: str, spec: Path, out: Path, sequential: bool = False,
               api_key: str | None = None) -> list[str]:
    """The command line of the client process: this script in client mode."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "client", url, str(spec), str(out)]
    cmd += ["--sequential"] if sequential else []
    return cmd + (["--api-key", api_key] if api_key else [])


def client_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="serve.py client",
                                description="the HTTP client process of bench/serve.py")
    p.add_argument("url")
    p.add_argument("requests")
    p.add_argument("out")
    p.add_argument("--sequential", action="store_true", help="one request at a time (TTFT)")
    p.add_argument("--api-key")
    a = p.parse_args(argv)
    spec = json.loads(open(a.requests).read())
    out = asyncio.run(client_run(a.url, spec["requests"], spec.get("sampling", {}), spec["model"],
                                 a.sequential, a.api_key))
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__" and sys.argv[1:2] == ["client"]:
    # here, before bench.common imports torch: the client needs only httpx, and torch's import
    # (~1.5 s of a busy core) would compete with the server inside the time that
    # bench/diagnostics/serve_host.py measures
    client_main(sys.argv[2:])
    sys.exit()

# ---------------------------------------------------------------- the server and the measurement

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (TINY_OF, base_parser, build_engine, error_row,  # noqa: E402
                          finish_cli, free_memory, log, make_workload, median, parse_dtype,
                          random_prompt, resolve_device, row, sampling, shutdown_engine, timed,
                          vocab_size)

TEMPERATURE = 0.6
# (prompt lengths, output lengths, TTFT prompt length) per scale
SCALES = {"gpu": ((100, 1024), (100, 1024), 1024),
          "cpu": ((16, 96), (16, 64), 128),
          "tiny": ((8, 48), (4, 16), 32)}


def http_run(server_url: str, model: str, requests, sequential: bool = False,
             api_key: str | None = None) -> dict:
    """The workload through the client process."""
    with tempfile.TemporaryDirectory(prefix="glassbox-serve-") as tmp:
        spec, out = Path(tmp) / "requests.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({
            "model": model, "sampling": {"temperature": TEMPERATURE, "ignore_eos": True},
            "requests": [{"prompt": r.prompt, "max_tokens": r.max_tokens} for r in requests]}))
        proc = subprocess.run(client_cmd(server_url, spec, out, sequential, api_key),
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"HTTP client failed: {proc.stderr.strip()[-800:]}")
        return json.loads(out.read_text())


def inproc_run(llm, requests, device) -> dict:
    """The same workload through llm.generate: wall time, tokens, per-request TTFT."""
    params = [sampling(temperature=TEMPERATURE, ignore_eos=True, max_tokens=r.max_tokens)
              for r in requests]
    outs, secs = timed(lambda: llm.generate([r.prompt for r in requests], params), device)
    return {"wall_s": secs, "results": [{"ttft_s": o.metrics.get("ttft_s"),
                                         "output_tokens": len(o.token_ids)} for o in outs]}


def inproc_ttft(llm, prompts: list[list[int]]) -> list[float]:
    """Idle engine, one request at a time: `llm.stream` call -> first event."""
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        for _ in llm.stream(p, sampling(temperature=0.0, max_tokens=1)):
            out.append(time.perf_counter() - t0)
            break
    return out


def summarise(run: dict, expected: int, path: str) -> tuple[float, int, float]:
    """(output tok/s, tokens, median TTFT ms) of one run. With ignore_eos every request runs
    to its max_tokens: a missing token is a bug, not noise."""
    tokens = sum(r["output_tokens"] for r in run["results"])
    if tokens != expected:
        raise RuntimeError(f"the {path} path produced {tokens} output tokens; the workload "
                           f"asks for {expected}")
    ttfts = [r["ttft_s"] for r in run["results"] if r["ttft_s"] is not None]
    return tokens / run["wall_s"], tokens, 1e3 * median(ttfts)


def main(model: str | None = None, device: str | None = None, dtype=None,
         num_requests: int | None = None, repeats: int = 3, ttft_repeats: int = 10,
         tiny: bool = False, max_model_len: int = 4096, engine_kwargs: dict | None = None,
         seed: int = 0) -> list[dict]:
    from api.server import BackgroundServer, create_app
    dev = resolve_device(device)
    dtype = parse_dtype(dtype)
    scale = "tiny" if tiny else ("gpu" if dev.type == "cuda" else "cpu")
    model = model or ("qwen3-0.6b" if scale == "gpu" else "demo")
    if tiny:
        model = TINY_OF.get(model, model)
        max_model_len = min(max_model_len, 256)
    if num_requests is None:
        num_requests = {"gpu": 256, "cpu": 16, "tiny": 3}[scale]
    prompt_len, output_len, ttft_len = SCALES[scale]
    id_high = min(10000, vocab_size(model))
    if scale == "cpu":
        max_model_len = min(max_model_len, 512)        # the demo checkpoint's limit
    kw = dict(prompt_len=prompt_len, output_len=output_len, id_high=id_high)
    engine_kwargs = dict(engine_kwargs or {})
    if scale == "cpu":      # room for the whole workload: no preemption noise
        engine_kwargs.setdefault("num_kv_blocks", 256)
    rows: list[dict] = []
    llm = server = None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=max_model_len, **engine_kwargs)
        server = BackgroundServer(create_app(llm))
        name = llm.model_name
        log(f"API on {server.url}/v1 serving {name}")
        # warm up both paths (kernels, graphs, the HTTP stack) outside the timed runs
        warm = [make_workload(8, seed=seed, id_stream=9998 + i, **kw) for i in range(2)]
        for r in warm[0] + warm[1]:
            r.max_tokens = min(r.max_tokens, 8)
        inproc_run(llm, warm[0], dev)
        http_run(server.url, name, warm[1])
        ours, api = [], []
        for rep in range(repeats):
            order = ("inproc", "api") if rep % 2 == 0 else ("api", "inproc")
            for path in order:
                stream = 2 * rep + (path == "api")
                reqs = make_workload(num_requests, seed=seed, id_stream=stream, **kw)
                expected = sum(r.max_tokens for r in reqs)
                run = inproc_run(llm, reqs, dev) if path == "inproc" else \
                    http_run(server.url, name, reqs)
                tok_s, tokens, ttft_ms = summarise(run, expected, path)
                log(f"{path} repeat {rep}: {tokens} tokens in {run['wall_s']:.2f}s = "
                    f"{tok_s:,.0f} tok/s, median TTFT under load {ttft_ms:.1f} ms")
                (ours if path == "inproc" else api).append((tok_s, ttft_ms))
        note = f"{num_requests} req, {expected} out tok, median of {repeats}"
        tput_in, tput_api = median([t for t, _ in ours]), median([t for t, _ in api])
        rows.append(row("serve", model, "glassbox", "output_tok_s", tput_in, "tok/s", note))
        rows.append(row("serve", model, "glassbox-api", "output_tok_s", tput_api, "tok/s", note))
        rows.append(row("serve", model, "overhead", "throughput_overhead_pct",
                        100.0 * (tput_in - tput_api) / tput_in, "%", "in-process vs HTTP"))
        rows.append(row("serve", model, "glassbox", "ttft_ms_loaded",
                        median([t for _, t in ours]), "ms", "median under the workload"))
        rows.append(row("serve", model, "glassbox-api", "ttft_ms_loaded",
                        median([t for _, t in api]), "ms", "median under the workload"))
        # TTFT on an idle engine, one request at a time; fresh prompts, no prefix hits
        p_in = [random_prompt(ttft_len, id_high, 500 + i) for i in range(ttft_repeats + 1)]
        p_api = [random_prompt(ttft_len, id_high, 700 + i) for i in range(ttft_repeats + 1)]
        t_in = inproc_ttft(llm, p_in)[1:]                   # the first one warms the shape
        from bench.common import Request
        got = http_run(server.url, name, [Request(p, 1) for p in p_api], sequential=True)
        t_api = [r["ttft_s"] for r in got["results"]][1:]
        m_in, m_api = 1e3 * median(t_in), 1e3 * median(t_api)
        tnote = f"{ttft_len}-token prompt, batch 1, median of {ttft_repeats}"
        rows.append(row("serve", model, "glassbox", f"ttft_ms_{ttft_len}", m_in, "ms", tnote))
        rows.append(row("serve", model, "glassbox-api", f"ttft_ms_{ttft_len}", m_api, "ms",
                        tnote))
        rows.append(row("serve", model, "overhead", "ttft_overhead_ms", m_api - m_in, "ms",
                        "HTTP - in-process"))
    except Exception as exc:
        rows.append(error_row("serve", model, "glassbox-api", exc))
    finally:
        if server is not None:
            server.stop()
        shutdown_engine(llm)
        free_memory(dev)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.set_defaults(model=None)
    p.add_argument("--gpu", action="store_true", help="same as --device cuda")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default: 256 on a GPU, 16 on the CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ttft-repeats", type=int, default=10)
    a = p.parse_args(argv)
    device = "cuda" if a.gpu else a.device
    if a.tiny:
        a.repeats, a.ttft_repeats = min(a.repeats, 1), min(a.ttft_repeats, 2)
    rows = main(a.model, device, a.dtype, a.num_requests, a.repeats, a.ttft_repeats, a.tiny)
    for r in rows:
        if r["metric"] == "throughput_overhead_pct":
            log(f"target (BENCH.md): throughput overhead <= 5 %: {r['value']:.1f} %")
        if r["metric"] == "ttft_overhead_ms":
            log(f"target (BENCH.md): TTFT overhead <= 5 ms: {r['value']:.2f} ms")
    finish_cli(rows, "serve", a.json)
    return rows


if __name__ == "__main__":
    cli()
