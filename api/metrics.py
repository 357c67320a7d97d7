"""/metrics in Prometheus' text format, with vLLM's metric names (a dashboard or alert written
for vLLM's server reads Glassbox's unchanged). One registry per router, never the process-wide
default one: two servers in one process (tests) keep separate counts.

Gauges and engine counters are read at scrape time from `LLM.stats()` (no engine work between
scrapes); per-request histograms and token totals are observed from each request's final
TokenEvent (`LLM.finish_listeners`), so the playground's chat counts as well as the API's.

| vLLM name | Glassbox source |
| --- | --- |
| vllm:num_requests_running / _waiting | scheduler queues |
| vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc (v0 name) | used KV blocks / all (0..1) |
| vllm:prefix_cache_queries_total / _hits_total | block manager, in tokens (full blocks x block size) |
| vllm:num_preemptions_total | scheduler |
| vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total | verifies with drafts, draft tokens, accepted ones (engine/spec_decode) |
| vllm:spec_decode_num_accepted_tokens_per_pos_total{position} | accepted drafts by their position in the draft |
| vllm:prompt_tokens_total, vllm:generation_tokens_total | counted when a request ends |
| vllm:request_success_total{finished_reason} | finish reasons (stop, length, abort) |
| vllm:time_to_first_token_seconds | arrival -> first token |
| vllm:e2e_request_latency_seconds | arrival -> finish |
| vllm:time_per_output_token_seconds | per request: decode time / (tokens - 1) (vLLM v0 observes each gap) |
| vllm:request_prompt_tokens, vllm:request_generation_tokens | per-request histograms |
| vllm:request_queue_time_seconds | arrival -> first scheduled |
| vllm:request_prefill_time_seconds | first scheduled -> first token |
| vllm:request_decode_time_seconds | first token -> last token |
| vllm:request_inference_time_seconds | first scheduled -> last token |
| vllm:inter_token_latency_seconds | each gap between a request's consecutive tokens |
| vllm:iteration_tokens_total | tokens (prefill + decode) of each engine step (`LLM.step_listeners`) |

Buckets are vLLM's (its eager-mode list for the iteration tokens, whose last bound vLLM writes
8096; 8192 here).
"""
from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0)
_PHASE = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineMetrics:
    """The registry of one router over `engines` (an object whose `.llm` may be replaced)."""

    def __init__(self, engines):
        self.engines = engines
        self.registry = r = CollectorRegistry(auto_describe=True)
        label = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              label, buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end",
                             label, buckets=_LATENCY, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Mean time per output token of a request (after the first)",
                              label, buckets=_TPOT, registry=r)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                    label, buckets=_TOKENS, registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens",
                                 "Generated tokens per request", label, buckets=_TOKENS,
                                 registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Time a request waited before it was first scheduled", label,
                               buckets=_PHASE, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds",
                                 "Time from first scheduled to first token", label,
                                 buckets=_PHASE, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds",
                                "Time from first token to last token", label, buckets=_PHASE,
                                registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds",
                                   "Time from first scheduled to last token", label,
                                   buckets=_PHASE, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a request's consecutive output tokens", label,
                             buckets=_ITL, registry=r)
        self.iteration = Histogram("vllm:iteration_tokens_total",
                                   "Tokens (prefill + decode) per engine step", label,
                                   buckets=_STEP_TOKENS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", label,
                                     registry=r)
        self.gen_tokens = Counter("vllm:generation_tokens", "Generated tokens", label,
                                  registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason",
                               label + ["finished_reason"], registry=r)
        r.register(_EngineCollector(self))
        self._attached: "weakref.WeakSet" = weakref.WeakSet()
        self._lock = threading.Lock()
        self.attach()

    def attach(self):
        """Listen to the current engine's finished requests (once per engine); returns it."""
        llm = self.engines.llm
        with self._lock:
            if llm not in self._attached:
                name = llm.model_name
                llm.finish_listeners.append(lambda ev: self.observe(name, ev))
                step = self.iteration.labels(name)
                llm.step_listeners.append(step.observe)
                self._attached.add(llm)
        return llm

    def observe(self, model: str, ev) -> None:
        """One request's final TokenEvent (engine thread: a few additions, nothing more)."""
        m = ev.metrics or {}
        n_prompt, n_out = int(m.get("num_prompt_tokens", 0)), int(m.get("num_output_tokens", 0))
        self.prompt_tokens.labels(model).inc(n_prompt)
        self.gen_tokens.labels(model).inc(n_out)
        self.req_prompt.labels(model).observe(n_prompt)
        self.req_gen.labels(model).observe(n_out)
        self.success.labels(model, ev.finish_reason or "abort").inc()
        if m.get("ttft_s") is not None:
            self.ttft.labels(model).observe(m["ttft_s"])
        if m.get("e2e_s") is not None:
            self.e2e.labels(model).observe(m["e2e_s"])
        if n_out > 1 and m.get("decode_s"):
            self.tpot.labels(model).observe(m["decode_s"] / (n_out - 1))
        if m.get("queue_s") is not None:
            self.queue.labels(model).observe(m["queue_s"])
        if m.get("prefill_s") is not None:
            self.prefill.labels(model).observe(m["prefill_s"])
            self.decode.labels(model).observe(m.get("decode_s") or 0.0)
            self.inference.labels(model).observe(m["prefill_s"] + (m.get("decode_s") or 0.0))
        gaps = m.get("inter_token_s")
        if gaps:
            itl = self.itl.labels(model)
            for g in gaps:
                itl.observe(g)

    def render(self) -> bytes:
        self.attach()
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and counters, read at scrape time."""

    def __init__(self, owner: EngineMetrics):
        self.owner = owner

    def describe(self):
        return []

    def collect(self):
        llm = self.owner.engines.llm
        if self.owner.engines.switching:
            return
        s = llm.stats()
        name, bs = [llm.model_name], s["block_size"]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c
        yield gauge("vllm:num_requests_running", "Requests in the running batch", s["num_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                    s["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage (1 = 100 %)", s["kv_usage"])
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = 100 %; vLLM v0's name)",
                    s["kv_usage"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                      "(whole blocks)", s["prefix_queries"] * bs)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache",
                      s["prefix_hits"] * bs)
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed later)",
                      s["num_preemptions"])
        spec = s.get("spec_decode")
        if spec is not None:
            yield counter("vllm:spec_decode_num_drafts", "Verify passes with at least one draft",
                          spec["num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                          spec["num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                          spec["num_accepted_tokens"])
            per = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft",
                                      labels=["model_name", "position"])
            for pos, n in enumerate(spec["accepted_per_pos"]):
                per.add_metric([name[0], str(pos)], n)
            yield per
