"""Smoke test: every bench entry point (the suite in bench/, the diagnostics in bench/diagnostics/)
runs end to end on a tiny model on the CPU in seconds, so the scripts never rot before the next
GPU run. Speeds are not checked (that is bench/'s job), only that
each script measures and reports what it claims, and that run_all survives a failing section."""
from __future__ import annotations

import json
import math
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

CPU = torch.device("cpu")


def _by_metric(rows: list[dict], system: str) -> dict[str, float]:
    return {r["metric"]: r["value"] for r in rows if r["system"] == system}


def _assert_no_errors(rows: list[dict]) -> None:
    errors = [r for r in rows if r["metric"] == "error"]
    assert not errors, errors


def _assert_positive(values: dict[str, float], names: list[str]) -> None:
    for n in names:
        assert n in values, (n, sorted(values))
        assert values[n] is not None and math.isfinite(values[n]) and values[n] > 0, (n, values[n])


# ---------------------------------------------------------------- pieces

def test_bench_config_dirs_carry_the_bench_md_shapes():
    from transformers import AutoConfig
    dense_dir = common.model_dir("qwen3-0.6b")
    c = AutoConfig.from_pretrained(dense_dir)
    assert c.architectures == ["Qwen3ForCausalLM"]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (151936, 1024, 3072, 28, 16, 8, 128)
    assert c.tie_word_embeddings is True
    assert c.max_position_embeddings == 40960 and c.rms_norm_eps == 1e-6
    raw = json.loads((dense_dir / "config.json").read_text())
    assert raw["rope_theta"] == 1e6  # the pre-v5 key that real checkpoints carry
    assert (dense_dir / "generation_config.json").exists()

    moe_dir = common.model_dir("qwen3-30b-a3b")
    m = AutoConfig.from_pretrained(moe_dir)
    assert m.architectures == ["Qwen3MoeForCausalLM"]
    assert (m.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
            m.num_key_value_heads, m.head_dim) == (151936, 2048, 48, 32, 4, 128)
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 768)
    assert m.norm_topk_prob is True and m.tie_word_embeddings is False
    assert m.decoder_sparse_step == 1 and list(m.mlp_only_layers) == []
    assert json.loads((moe_dir / "config.json").read_text())["num_experts"] == 128


def test_workload_follows_the_nano_vllm_protocol():
    a = common.make_workload(256, seed=0, id_stream=0)
    b = common.make_workload(256, seed=0, id_stream=0)
    again = common.make_workload(256, seed=0, id_stream=1)
    assert [r.prompt for r in a] == [r.prompt for r in b]  # deterministic
    assert all(100 <= len(r.prompt) <= 1024 and 100 <= r.max_tokens <= 1024 for r in a)
    assert all(0 <= t < 10000 for r in a for t in r.prompt)
    # a repeat keeps every length and changes the ids, so it never hits the prefix cache
    assert [(len(r.prompt), r.max_tokens) for r in a] == \
        [(len(r.prompt), r.max_tokens) for r in again]
    assert all(x.prompt[:16] != y.prompt[:16] for x, y in zip(a, again))


def test_targets_report_met_missed_and_not_measured():
    rows = [common.row("latency", "qwen3-0.6b", "glassbox", "decode_tok_s", 1200.0, "tok/s"),
            common.row("latency", "qwen3-0.6b", "glassbox", "ttft_ms_1024", 30.0, "ms")]
    status = {t["target"]: t["status"] for t in common.target_rows(rows)}
    assert status["Qwen3-0.6B batch-1 decode >= 1,000 tok/s"] == "met"
    assert status["Qwen3-0.6B TTFT (1,024-token prompt) <= 8 ms"] == "missed"
    assert status["Qwen3-0.6B throughput >= 20,000 tok/s"] == "not measured"


def test_floors_measure_positive_rates_on_cpu():
    assert common.measure_copy_bandwidth(CPU, nbytes=4 << 20, iters=2) > 0
    assert common.measure_matmul_flops(CPU, n=64, iters=2) > 0


def test_hf_peer_generates_exactly_the_requested_tokens():
    model = common.build_hf("tiny", CPU)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert common.hf_generate(model, [[5, 6, 7], [8, 9]], 3, CPU) == 6
    reqs = [common.Request([5, 6, 7, 8], 3), common.Request([9, 10], 5)]
    tokens, secs = common.hf_generate_batch(model, reqs, CPU)
    assert tokens == 8 and secs > 0


# ---------------------------------------------------------------- each entry point

def test_throughput_runs_tiny_on_cpu():
    from bench import throughput
    rows = throughput.main("qwen3-0.6b", "cpu", num_requests=3, repeats=1, hf_num_requests=2,
                           tiny=True, floors=False)
    _assert_no_errors(rows)
    _assert_positive(_by_metric(rows, "glassbox"), ["output_tok_s"])
    _assert_positive(_by_metric(rows, "hf-generate_batch"), ["output_tok_s"])
    _assert_positive(_by_metric(rows, "ratio"), ["output_tok_s"])


def test_latency_runs_tiny_on_cpu():
    from bench import latency
    rows = latency.main("qwen3-0.6b", "cpu", repeats=1, hf_repeats=1, tiny=True, floors=True)
    _assert_no_errors(rows)
    _assert_positive(_by_metric(rows, "device"), ["copy_bandwidth", "matmul_fp32"])
    for system in ("glassbox", "hf-generate"):
        _assert_positive(_by_metric(rows, system), ["decode_tok_s", "ms_per_token", "ttft_ms_32"])
    _assert_positive(_by_metric(rows, "ratio"), ["decode_tok_s", "ttft_ms_32"])


def test_spec_decode_runs_tiny_on_cpu_and_speculation_is_exact():
    from bench import spec_decode
    rows = spec_decode.main("qwen3-0.6b", "cpu", repeats=1, tiny=True, floors=False)
    _assert_no_errors(rows)
    _assert_positive(_by_metric(rows, "plain"), ["decode_tok_s"])
    for system in ("ngram-random", "oracle-100", "oracle-80", "oracle-50", "oracle-0"):
        got = _by_metric(rows, system)
        _assert_positive(got, ["decode_tok_s", "tokens_per_step", "speedup"])
        assert got["exact"] == 1.0, system          # greedy output unchanged by speculation
    assert _by_metric(rows, "oracle-100")["acceptance"] == 1.0
    assert _by_metric(rows, "oracle-0")["acceptance"] == 0.0
    assert _by_metric(rows, "oracle-100")["tokens_per_step"] > 2
    _assert_positive(_by_metric(rows, "workload-plain"), ["output_tok_s"])
    many = _by_metric(rows, "workload-ngram")
    _assert_positive(many, ["output_tok_s", "speedup"])
    assert many["exact_share"] == 1.0           # seeded sampling: plain decoding's tokens


def test_spec_decode_draft_cost_runs_tiny_on_cpu():
    """The draft-model cost model: the tiny draft of the tiny target is the target itself, so it
    drafts the target's own greedy tokens (acceptance 1) and each step's costs add up."""
    import torch

    from bench import spec_decode
    rows = spec_decode.draft_cost("qwen3-8b", "qwen3-0.6b", torch.device("cpu"), None,
                                  repeats=1, tiny=True, bench="spec_decode")
    _assert_no_errors(rows)
    draft = _by_metric(rows, "draft")
    _assert_positive(draft, ["decode_tok_s", "step_ms", "verify_ms",
                             "break_even_tokens_per_step"])
    assert draft["acceptance"] == 1.0
    plain = _by_metric(rows, "plain")
    assert abs(draft["break_even_tokens_per_step"] - draft["step_ms"] / plain["step_ms"]) < 1e-9
    assert abs(draft["propose_ms"] - (draft["step_ms"] - draft["verify_ms"])) < 1e-9


def test_spec_decode_oracle_alpha_gives_the_target_acceptance_rate():
    from bench.spec_decode import alpha_for
    assert alpha_for(1.0) > 0.999 and alpha_for(0.0) < 1e-6
    for rate in (0.8, 0.5):
        a = alpha_for(rate)
        assert abs(sum(a ** i for i in range(1, 5)) / 4 - rate) < 1e-9


def test_long_context_runs_tiny_on_cpu_with_its_floors():
    from bench import long_context
    rows = long_context.main("qwen3-0.6b", "cpu", tiny=True, repeats=1)
    _assert_no_errors(rows)
    mine = _by_metric(rows, "glassbox")
    _assert_positive(mine, ["ttft_ms_64", "ttft_ms_128", "decode_ms_per_token_96"])
    assert all("floor" in r["note"] for r in rows if r["system"] == "glassbox")
    _assert_positive(_by_metric(rows, "ratio"), ["ttft_ms_64"])


def test_shared_prefix_runs_tiny_on_cpu_through_the_cascade():
    from bench import shared_prefix
    rows = shared_prefix.main("qwen3-0.6b", "cpu", tiny=True, repeats=1, hf_num_requests=2)
    _assert_no_errors(rows)
    shared = next(r for r in rows if r["metric"] == "shared_tok_s_cascade"
                  and r["system"] == "glassbox")
    assert shared["value"] > 0 and " 0 cascade steps" not in shared["note"]
    off = next(r for r in rows if r["metric"] == "shared_tok_s_no_cascade")
    assert "; 0 cascade steps" in off["note"]
    _assert_positive(_by_metric(rows, "ratio"), ["shared_tok_s_cascade"])


def test_probes_runs_tiny_on_cpu():
    from bench import probes
    rows = probes.main("qwen3-0.6b", "cpu", num_requests=3, tput_repeats=1, lat_repeats=1,
                       tiny=True, floors=False)
    _assert_no_errors(rows)
    got = _by_metric(rows, "glassbox")
    _assert_positive(got, ["output_tok_s[off]", "output_tok_s[norms+routing]",
                           "ms_per_token[off]", "ms_per_token[attention]"])
    for name in ("throughput_slowdown_pct[norms+routing]", "decode_slowdown_pct[norms+routing]",
                 "decode_slowdown_pct[attention]"):
        assert math.isfinite(got[name])  # a slowdown may come out negative on a noisy CPU


def test_watched_runs_tiny_on_cpu_with_the_pages_polling():
    from bench import watched
    rows = watched.main("qwen3-0.6b", "cpu", num_requests=3, tput_repeats=1, lat_repeats=1,
                        tiny=True, floors=False)
    _assert_no_errors(rows)
    got = _by_metric(rows, "glassbox")
    assert "poller_errors" not in got, [r for r in rows if r["metric"] == "poller_errors"]
    _assert_positive(got, ["ms_per_token[nobody watching]", "ms_per_token[KV+Layers+Engine tabs]",
                           "output_tok_s[nobody watching]", "output_tok_s[KV+Layers+Engine tabs]",
                           "tab_build_p50[kv]", "tab_build_p50[layers]", "tab_build_p50[engine]"])
    for name in ("decode_slowdown_pct", "throughput_slowdown_pct"):
        assert math.isfinite(got[name])
    # each timed run says what it compiled and captured (eager on the CPU: no graphs)
    for label in ("batch 1 off, repeat 0", "batch 1 on, repeat 0", "throughput off, repeat 0",
                  "throughput on, repeat 0"):
        assert got[f"triton_compiles[{label}]"] >= 0
        assert got[f"graphs_captured[{label}]"] == 0


def test_watched_ledger_counts_what_each_run_compiled_and_captured():
    from types import SimpleNamespace

    from bench.watched import RunLedger
    decode, prefill = SimpleNamespace(graphs={(1, None, None): 0}), SimpleNamespace(graphs={})
    llm = SimpleNamespace(runner=SimpleNamespace(graphs=decode, prefill_graphs=prefill))
    ledger = RunLedger(llm)
    try:
        def first():                # what a first run may pay: two compiles, three captures
            ledger.compiles.entries += [("_prefill_kernel", 0.8), ("_partial_kernel", 0.25)]
            decode.graphs.update({(4, "lens", None): 0, (8, "lens", None): 0})
            prefill.graphs[(512, None)] = 0
            return 17.5
        assert ledger.run("throughput off, repeat 0", first) == 17.5
        assert ledger.run("throughput on, repeat 0", lambda: 21.8) == 21.8
    finally:
        ledger.close()
    got = {r["metric"]: r for r in ledger.as_rows("m")}
    assert got["triton_compiles[throughput off, repeat 0]"]["value"] == 2
    assert "_partial_kernel, _prefill_kernel" in got["triton_compiles[throughput off, repeat 0]"]["note"]
    assert got["graphs_captured[throughput off, repeat 0]"]["value"] == 3
    assert got["triton_compiles[throughput on, repeat 0]"]["value"] == 0
    assert got["graphs_captured[throughput on, repeat 0]"]["value"] == 0


def test_moe_runs_tiny_on_cpu():
    from bench import moe
    rows = moe.main("qwen3-30b-a3b", "cpu", num_requests=3, lat_repeats=1, tiny=True,
                    floors=False)
    _assert_no_errors(rows)
    assert {r["model"] for r in rows} == {"tiny-moe"}
    _assert_positive(_by_metric(rows, "glassbox"), ["decode_tok_s", "output_tok_s"])
    _assert_positive(_by_metric(rows, "hf-generate"), ["decode_tok_s", "output_tok_s"])
    _assert_positive(_by_metric(rows, "ratio"), ["decode_tok_s", "output_tok_s"])


def test_latency_cpu_mode_runs_tiny_on_cpu():
    from bench import latency
    threads = torch.get_num_threads()
    rows = latency.cpu_main(tiny=True, floors=False, threads=threads)
    _assert_no_errors(rows)
    assert {r["bench"] for r in rows} == {"cpu"}
    _assert_positive(_by_metric(rows, "glassbox"), ["decode_tok_s"])
    _assert_positive(_by_metric(rows, "hf-generate"), ["decode_tok_s"])
    _assert_positive(_by_metric(rows, "ratio"), ["decode_tok_s"])


def test_serve_runs_tiny_on_cpu_through_http_and_in_process():
    from bench import serve
    rows = serve.main(device="cpu", repeats=1, ttft_repeats=2, tiny=True)
    _assert_no_errors(rows)     # includes: every workload token arrived over HTTP
    assert {r["model"] for r in rows} == {"tiny"}
    for system in ("glassbox", "glassbox-api"):
        _assert_positive(_by_metric(rows, system), ["output_tok_s", "ttft_ms_32",
                                                    "ttft_ms_loaded"])
    over = _by_metric(rows, "overhead")
    assert math.isfinite(over["throughput_overhead_pct"]) and math.isfinite(over["ttft_overhead_ms"])


# ---------------------------------------------------------------- run_all

def test_run_all_writes_json_and_markdown_and_survives_a_failing_section(tmp_path, monkeypatch):
    from bench import run_all

    def failing(out_json=None):
        raise RuntimeError("boom")

    monkeypatch.setitem(sys.modules, "bench.kernels", types.SimpleNamespace(
        main=lambda out_json=None: [{"kernel": "fake", "us": 1.0, "pct_of_floor": 50.0}]))
    monkeypatch.setitem(sys.modules, "bench.moe_kernels", types.SimpleNamespace(main=failing))
    monkeypatch.setenv("OUT", str(tmp_path))
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# Results\n")
    report = run_all.main(["--device", "cpu", "--tiny", "--skip-hf", "--only",
                           "moe_kernels,kernels,latency", "--results-md", str(results_md)])
    status = {s["section"]: s["status"] for s in report["sections"]}
    assert status["latency"] == "ok" and status["kernels"] == "ok"
    assert status["moe_kernels"].startswith("failed")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["kernel_rows"][0]["kernel"] == "fake"
    assert any(r["metric"] == "decode_tok_s" and r["value"] > 0 for r in saved["rows"])
    assert any(r["bench"] == "moe_kernels" and r["metric"] == "error" for r in saved["rows"])
    md = results_md.read_text()
    assert md.startswith("# Results\n") and "### Targets (BENCH.md)" in md
    assert "python bench/run_all.py --device cpu --tiny" in md
    assert (tmp_path / "bench.md").read_text() in md


def test_a_section_past_its_time_limit_keeps_its_finished_figures():
    from bench.run_all import Section, run_sections

    def slow():
        common.row("slow", "-", "glassbox", "done_before_timeout", 1.0, "x")
        time.sleep(10)
        return []

    sections = [Section("slow", 0.5, slow),
                Section("after", 30, lambda: [common.row("after", "-", "glassbox", "m", 2.0, "x")])]
    t0 = time.perf_counter()
    rows, _, status = run_sections(sections, budget_s=100, reserve_s=0)
    assert time.perf_counter() - t0 < 5
    assert [s["status"] for s in status] == ["timeout", "ok"]
    assert [r["metric"] for r in rows] == ["done_before_timeout", "error", "m"]


# ---------------------------------------------------------------- bench/diagnostics

def test_host_overhead_bench_runs_and_reports_a_positive_time():
    from bench.diagnostics import host_overhead
    out = host_overhead.main(batch=8, steps=3)
    assert out["batch"] == 8 and out["host_ms_per_step"] > 0


def test_sampling_extras_guided_runs_tiny_on_cpu_generate_and_streamed(capsys):
    from bench.diagnostics import sampling_extras
    res = sampling_extras.main(["--tiny", "--only", "guided", "--repeats", "1", "--tokens", "8"])
    for key in ("guided_cost_pct", "streamed_guided_cost_pct"):
        assert math.isfinite(res[key]), res
    assert res["streamed_ms_per_token"] > 0 and res["streamed_guided_ms_per_token"] > 0


def test_attention_tune_checks_each_variant_against_the_reference(capsys, triton_interpreter):
    from bench.diagnostics import attention_tune
    from engine.kernels import decode_attention as DA
    before = (dict(DA.DIRECT_LAUNCH), dict(DA.SPLIT_LAUNCH), DA.DIRECT_WIDE_BLOCK_N,
              DA.WIDE_FROM_PROGRAMS)
    attention_tune.main(["--smoke", "--batches", "2", "--contexts", "24", "--splits", "3"])
    out = capsys.readouterr().out
    assert "engine today" in out and "!!" not in out and "failed" not in out
    # the variants go to the kernel as arguments: the engine's launch tables are untouched
    assert (dict(DA.DIRECT_LAUNCH), dict(DA.SPLIT_LAUNCH), DA.DIRECT_WIDE_BLOCK_N,
            DA.WIDE_FROM_PROGRAMS) == before


def test_decode_chain_runs_every_family_of_variants_tiny_and_restores_what_it_touched(capsys, triton_interpreter):
    from bench.diagnostics import decode_chain
    from engine.kernels import decode_attention as DA
    before = (dict(DA.SPLIT_LAUNCH), decode_chain.LAYERS, decode_chain.HIDDEN)
    decode_chain.main(["--smoke"])
    out = capsys.readouterr().out
    for row in ("whole chain:", "| attn |", "whole weight tile", "wider programs", "attention 2 splits",
                "split tiles", "epilogue: False"):
        assert row in out, row
    assert (dict(DA.SPLIT_LAUNCH), decode_chain.LAYERS, decode_chain.HIDDEN) == before


def test_kernel_ab_alternates_kernel_choices_in_fresh_processes(tmp_path):
    """bench/diagnostics/kernel_ab.py: each variant's KernelConfig choices reach the engine
    config its own process builds, rounds alternate, a failing run becomes an error row with the
    reason instead of stopping the others, and a bad name or value is refused before any run."""
    from bench.diagnostics import kernel_ab
    probe = tmp_path / "probe.py"  # a stand-in bench script: reports the KernelConfig it gets
    probe.write_text(
        "import json, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from engine.kernel_config import KernelConfig\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        "k = KernelConfig.build()\n"
        "if not k.prefill_graphs:\n"
        "    raise SystemExit('RuntimeError: boom without prefill graphs')\n"
        "rows = [{'system': 'glassbox', 'metric': 'decode_tok_s', 'value': float(k.pdl)},\n"
        "        {'system': 'glassbox', 'metric': 'ttft_ms_caps', 'value': float(len(k.attn_context_caps))},\n"
        "        {'system': 'hf', 'metric': 'decode_tok_s', 'value': -1.0},\n"
        "        {'system': 'glassbox', 'metric': 'unrelated', 'value': 3.0}]\n"
        "open(out, 'w').write(json.dumps(rows))\n")
    variants = [kernel_ab.parse_variant("pdl=1"), kernel_ab.parse_variant("prefill_graphs=0"),
                kernel_ab.parse_variant("pdl=0,attn_context_caps=512")]
    rows = kernel_ab.main(variants, [str(probe)], rounds=2, timeout=120)
    labels = ["pdl=1", "prefill_graphs=0", "pdl=0,attn_context_caps=512"]
    assert list(dict.fromkeys((r["variant"], r["round"]) for r in rows)) == \
        [(v, r) for r in (1, 2) for v in labels]
    assert [r["value"] for r in rows if r["metric"] == "decode_tok_s"] == [1.0, 0.0, 1.0, 0.0]
    assert [r["value"] for r in rows if r["metric"] == "ttft_ms_caps"] == [4.0, 1.0, 4.0, 1.0]
    errors = [r for r in rows if r["metric"] == "error"]
    assert len(errors) == 2 and all("boom without prefill graphs" in r["value"] for r in errors)
    md = kernel_ab.table(rows)
    assert "| pdl=0,attn_context_caps=512 | 0 | 0 | 1 | 1 |" in md
    with pytest.raises(ValueError, match="NAME=VALUE"):
        kernel_ab.parse_variant("no-equals-sign")
    with pytest.raises(ValueError, match="valid names: pdl"):
        kernel_ab.parse_variant("GLASSBOX_PDL=0")
    with pytest.raises(ValueError, match="must be true or false"):
        kernel_ab.parse_variant("pdl=maybe")


def test_first_run_reports_each_repeat_with_its_compiles_on_cpu():
    from bench.diagnostics import first_run
    rows = first_run.main("qwen3-0.6b", "cpu", num_requests=4, repeats=2, tiny=True)
    _assert_no_errors(rows)
    for r in ("repeat 0", "repeat 1"):
        got = {x["metric"]: x["value"] for x in rows if x["note"].startswith(r)}
        assert got["output_tok_s"] > 0 and got["decode_step_ms"] > 0, got
        assert got["triton_compiles"] == 0      # the CPU runs no Triton kernel
    import gc
    assert gc.isenabled()


def test_spec_steps_splits_verify_and_plain_steps_on_cpu(capsys):
    from bench.diagnostics import spec_steps
    spec_steps.main(["--tiny", "--device", "cpu"])
    out = capsys.readouterr().out
    for run in ("plain:", "oracle-100:", "oracle-50:", "ngram:"):
        assert run in out, out
    assert "verify" in out and "propose" in out and "forward" in out


def test_step_profile_verify_profiles_plain_and_verify_steps_on_cpu(capsys):
    from bench.diagnostics import step_profile
    step_profile.main(["--tiny", "--device", "cpu", "--verify"])
    out = capsys.readouterr().out
    assert "== plain:" in out and "== verify (oracle 100 %):" in out, out


def test_moe_chain_runs_every_family_of_variants_tiny_and_restores_its_shapes(capsys, triton_interpreter):
    from bench.diagnostics import moe_chain
    before = (moe_chain.LAYERS, moe_chain.HIDDEN, moe_chain.EXPERTS)
    moe_chain.main(["--smoke"])
    out = capsys.readouterr().out
    for row in ("whole chain:", "| router |", "its own launch", "router tile", "attention 2 splits"):
        assert row in out, row
    assert (moe_chain.LAYERS, moe_chain.HIDDEN, moe_chain.EXPERTS) == before


def test_skinny_gemm_smoke_checks_its_configs_against_f_linear(capsys, triton_interpreter):
    from bench.diagnostics import skinny_gemm
    skinny_gemm.smoke()
    assert "smoke ok" in capsys.readouterr().out


def test_serve_host_streams_its_fake_engine_through_the_api(capsys):
    """bench/diagnostics/serve_host.py: its fake engine is a whole EngineClient (the API may
    come to read any member of the protocol: checked here, not at the next run), and every
    stream gets all its tokens over HTTP."""
    from bench.diagnostics import serve_host
    from engine.client import EngineClient
    llm = serve_host.FakeLLM(busy_ms=0.1, wait_ms=0.1)
    llm.shutdown()
    members = set(EngineClient.__annotations__) | {n for n in vars(EngineClient)
                                                   if not n.startswith("_")}
    assert not [n for n in sorted(members) if not hasattr(llm, n)]
    res = serve_host.main(["--streams", "4", "--max-tokens", "20", "--alone-s", "0.3"])
    assert res["streamed_tokens"] == 4 * 20
    _assert_positive(res, ["alone_steps_s", "served_steps_s", "tok_s"])
    assert math.isfinite(res["server_us_per_token"])
    assert "4 streams x 20 tokens: engine alone" in capsys.readouterr().out


def test_the_suite_stays_small_and_every_diagnostic_is_listed_in_the_readme():
    """bench/ holds the suite (what run_all runs and the few scripts run standalone, at most 15
    files: a helper lives in the script it serves); bench/diagnostics/ the rest, each with its
    line in bench/README.md."""
    bench = ROOT / "bench"
    assert len(list(bench.glob("*.py"))) <= 15
    readme = (bench / "README.md").read_text()
    for p in sorted((bench / "diagnostics").glob("*.py")) + sorted(bench.glob("*.py")):
        assert f"`{p.name}`" in readme, p.name


def test_bench_engine_runs_in_the_process_app_py_runs():
    """The benches measure a serving process: app.py's launch freezes the heap after loading
    (engine/process_tuning.py), so build_engine must too — without it a full GC in watched.py's
    poller threads walked the loaded model's objects (86-126 ms ticks on the H200). And
    shutdown_engine must unfreeze, or every engine a run_all process builds stays uncollectable."""
    import gc
    gc.unfreeze()
    llm = common.build_engine("tiny", torch.device("cpu"), torch.float32, max_model_len=256)
    try:
        assert gc.get_freeze_count() > 0, "build_engine left the heap unfrozen"
        assert sys.getswitchinterval() <= 2e-4 + 1e-9
    finally:
        common.shutdown_engine(llm)
    assert gc.get_freeze_count() == 0, "shutdown_engine left the engine's objects frozen"
