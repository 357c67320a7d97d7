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


def test_the_engine_tab_headline_tells_the_acceptance_rate():
    from engine.records import StepTrace
    from views.engine_view import speculation_note

    def trace(i, verifies):
        return StepTrace(step_id=i, wall_time=0.0, entries=[], num_prefill_tokens=0,
                         num_decode_tokens=1, t_schedule=0, t_prepare=0, t_forward=0,
                         t_sample=0, graph_bucket=None, num_running=1, num_waiting=0,
                         kv_usage=0.1, num_draft_tokens=sum(len(d) for _, d, _ in verifies),
                         num_accepted_tokens=sum(a for _, _, a in verifies), verifies=verifies,
                         t_propose=0.001 if verifies else 0.0)
    assert speculation_note([trace(0, ())]) == ""
    note = speculation_note([trace(0, (("r", (1, 2, 3, 4), 3),)), trace(1, ()),
                             trace(2, (("r", (5, 6, 7, 8), 1),))])
    assert "**50%** of 8 draft tokens accepted" in note
    assert "**3.00** tokens per verify" in note
    assert "1.00 ms proposing per verify" in note


def test_the_chat_reply_stats_tell_how_much_drafting_paid():
    from engine.sequence import TokenEvent
    from views.chat import format_stats
    m = {"num_output_tokens": 20, "prefix_cached_blocks": 0,
         "spec_decode": {"num_drafts": 5, "num_draft_tokens": 18, "num_accepted_tokens": 11,
                         "speculating": True}}
    line = format_stats(TokenEvent("chat-1", None, "", "", True, "stop", metrics=m), "done")
    assert "**11** of 18 drafted tokens accepted (5 verifies)" in line
    plain = format_stats(TokenEvent("chat-2", None, "", "", True, "stop",
                                    metrics={"num_output_tokens": 3}), "done")
    assert "drafted" not in plain


def test_serve_with_a_draft_model_speculative_config(qwen3_dir):
    """`python app.py serve TARGET --speculative-config '{"model": DRAFT, ...}'`: the flags
    give the engine its draft model (here the target drafting for itself: every draft
    accepted), and /metrics counts its drafts under vLLM's names."""
    import json

    from api.cli import engine_kwargs, parse
    js = json.dumps({"model": qwen3_dir, "num_speculative_tokens": 3})
    args = parse(["serve", qwen3_dir, "--device", "cpu", "--block-size", "4",
                  "--num-kv-blocks", "64", "--speculative-config", js])
    with LLM(args.model, **engine_kwargs(args)) as llm:
        assert llm.draft is not None and llm.config.speculative_config.method == "draft_model"
        metrics = EngineMetrics(SimpleNamespace(llm=llm, switching=False))
        out = llm.generate([[11, 12, 13, 14, 15]], SamplingParams(temperature=0, max_tokens=20,
                                                                  ignore_eos=True))[0]
        fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.name: s.value for f in fams.values() for s in f.samples}
    drafted = sum(len(v.drafted) for v in out.drafts)
    assert drafted > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total"] == drafted
    assert samples["vllm:spec_decode_num_accepted_tokens_total"] == drafted
