"""Speculative decoding as served: vLLM's vllm:spec_decode_* counters on /metrics' registry
(apart from tests/test_spec_decode.py, which a machine without the API's packages runs)."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from api.metrics import EngineMetrics
from engine import LLM, SamplingParams


def test_spec_decode_counters_use_vllms_names(qwen3_dir):
    base = [11, 12, 13, 14, 15, 16] * 4
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=64,
             speculative_config='{"method": "ngram", "num_speculative_tokens": 3}') as llm:
        metrics = EngineMetrics(SimpleNamespace(llm=llm, switching=False))
        out = llm.generate([base + [20], base + [21]],
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {(s.name, s.labels.get("position")): s.value
               for f in fams.values() for s in f.samples}
    drafts = sum(len(o.drafts) for o in out)
    drafted = sum(len(v.drafted) for o in out for v in o.drafts)
    accepted = sum(v.num_accepted for o in out for v in o.drafts)
    assert drafts > 0
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == drafted
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == accepted
    per_pos = [samples.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i)), 0)
               for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
