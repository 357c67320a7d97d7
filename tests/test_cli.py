"""The command line speaks vLLM's `serve`: a vLLM launch command starts Glassbox unchanged
(`vllm serve` -> `python app.py serve`), flags mean what they mean there, and a flag with no
meaning here is refused in one line that names it and says what Glassbox does instead."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "assets" / "demo-qwen3"

VLLM_LINE = ("serve Qwen/Qwen3-0.6B --served-model-name qwen3 small --gpu-memory-utilization 0.5 "
             "-tp 2 --enable-prefix-caching --tool-call-parser hermes --enable-auto-tool-choice "
             "--reasoning-parser qwen3 --generation-config auto --seed 7 --max-num-seqs 8 "
             "--max-num-batched-tokens 2048 --enable-chunked-prefill --disable-log-requests "
             "--uvicorn-log-level warning --response-role assistant --root-path /llm "
             "--allowed-origins https://app.example --max-model-len 1024 --dtype float "
             "--block-size 32 --enforce-eager")


def parse(line: str):
    import app
    return app.parse_args(line.split())


def refused(capsys, line: str) -> str:
    """The one-line refusal parse_args prints (exit status 2), never argparse's usage dump."""
    with pytest.raises(SystemExit) as e:
        parse(line)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_vllm_serve_command_line_parses_with_vllms_meaning():
    from api.cli import engine_kwargs
    args = parse(VLLM_LINE)
    assert args.model == "Qwen/Qwen3-0.6B"
    assert args.served_model_name == ["qwen3", "small"]
    assert args.root_path == "/llm" and args.allowed_origins == ["https://app.example"]
    assert args.port == 8000                        # `serve` listens where vLLM does
    assert engine_kwargs(args) == dict(
        device=None, dtype="float32", tensor_parallel_size=2, block_size=32, num_kv_blocks=None,
        gpu_memory_utilization=0.5, max_num_seqs=8, max_num_batched_tokens=2048,
        max_model_len=1024, enable_prefix_caching=True, enforce_eager=True, seed=7,
        speculative_config=None)


def test_speculative_config_is_passed_to_the_engine_as_given():
    from api.cli import engine_kwargs
    from engine.spec_decode import SpeculativeConfig
    js = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":5}'
    kw = engine_kwargs(parse(f"serve m --speculative-config {js}"))
    assert kw["speculative_config"] == js
    c = SpeculativeConfig.parse(kw["speculative_config"])
    assert (c.num_speculative_tokens, c.prompt_lookup_max) == (3, 5)


def test_the_readmes_vllm_serve_line_parses_unchanged():
    import shlex
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if l.startswith("python app.py serve "))
    import app
    args = app.parse_args(shlex.split(line.replace("$VLLM_API_KEY", "k"))[2:])
    assert args.model == "Qwen/Qwen3-0.6B" and args.served_model_name == ["qwen3"]
    assert args.api_key == "k" and args.port == 8000


@pytest.mark.parametrize("line", ["serve some/model", "some/model", "--model some/model"])
def test_the_model_is_positional_after_serve_or_alone_or_the_old_flag(line):
    assert parse(line).model == "some/model"


def test_no_model_is_the_bundled_demo_on_the_playgrounds_port():
    args = parse("")
    assert args.model is None and args.port == 7860
    assert parse("--tp 2").tensor_parallel_size == 2        # today's short flag still works


@pytest.mark.parametrize("spelling,dtype", [("auto", None), ("half", "float16"),
                                            ("float16", "float16"), ("bfloat16", "bfloat16"),
                                            ("float", "float32"), ("float32", "float32"),
                                            ("bf16", "bfloat16")])
def test_dtype_takes_vllms_spellings(spelling, dtype):
    from api.cli import engine_kwargs
    assert engine_kwargs(parse(f"serve m --dtype {spelling}"))["dtype"] == dtype


def test_prefix_caching_can_be_turned_off_as_in_vllm():
    from api.cli import engine_kwargs
    assert engine_kwargs(parse("serve m --no-enable-prefix-caching"))["enable_prefix_caching"] \
        is False
    assert engine_kwargs(parse("serve m"))["enable_prefix_caching"] is True


@pytest.mark.parametrize("line,named,instead", [
    ("serve m --trust-remote-code", "--trust-remote-code", "never runs code from a checkpoint"),
    ("serve m --chat-template ./t.jinja", "--chat-template", "checkpoint's own chat template"),
    ("serve m --tool-call-parser mistral", "--tool-call-parser mistral", "hermes"),
    ("serve m --reasoning-parser granite", "--reasoning-parser granite", "<think>"),
    ("serve m --generation-config vllm", "--generation-config vllm", "generation_config.json"),
    ("serve m --response-role bot", "--response-role bot", "assistant"),
    ("serve m --dtype int8", "--dtype int8", "float32"),
    ("serve m --quantization awq", "--quantization", "unquantized"),
    ("serve m --no-such-flag", "--no-such-flag", "--help"),
])
def test_a_flag_with_no_meaning_here_is_refused_in_one_line(capsys, line, named, instead):
    err = refused(capsys, line)
    assert named in err and instead in err, err


def test_flags_that_only_tune_vllm_are_accepted_and_say_so_once():
    from api.cli import startup_notes
    args = parse("serve m --disable-log-requests --disable-log-stats --swap-space 4")
    note = startup_notes(args)
    assert note.count("\n") == 0
    for flag in ("--disable-log-requests", "--disable-log-stats", "--swap-space"):
        assert flag in note
    assert startup_notes(parse("serve m --tool-call-parser hermes --enable-auto-tool-choice "
                               "--reasoning-parser deepseek_r1")) is None   # what we do anyway


def test_a_vllm_api_key_in_the_environment_is_honoured(monkeypatch):
    from api.auth import resolve_api_key
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(None) == "from-vllm"
    monkeypatch.setenv("GLASSBOX_API_KEY", "ours")
    assert resolve_api_key(None) == "ours"
    assert resolve_api_key("flag") == "flag"


def test_binding_beyond_localhost_with_only_a_vllm_key_starts(monkeypatch):
    """`VLLM_API_KEY=... vllm serve M --host 0.0.0.0`: the key counts for the exposure check."""
    import app
    monkeypatch.delenv("GLASSBOX_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "k")
    from api import resolve_api_key
    from api.auth import exposure_refusal
    args = app.parse_args(["serve", "m", "--host", "0.0.0.0"])
    assert exposure_refusal(args.host, resolve_api_key(args.api_key), False, False) is None


# ---- the typical vLLM launch, for real -----------------------------------------------------------
@pytest.mark.slow
def test_app_serve_with_a_vllm_flag_set_answers_under_the_served_name(tmp_path):
    if not (DEMO / "config.json").exists():
        pytest.skip("needs assets/demo-qwen3")
    from ui_helpers import free_port
    port = free_port()
    cmd = [sys.executable, "app.py", "serve", "assets/demo-qwen3", "--served-model-name", "demo",
           "--max-num-seqs", "8", "--dtype", "float", "--port", str(port),
           "--disable-log-requests", "--device", "cpu", "--enable-prefix-caching",
           "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--seed", "0",
           "--uvicorn-log-level", "warning", "--num-gpu-blocks-override", "64"]
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1")
    env.pop("GLASSBOX_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline, models = time.time() + 240, None
        while time.time() < deadline and proc.poll() is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                if models.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        text = log.read_text()
        assert models is not None and models.status_code == 200, text[-3000:]
        assert [m["id"] for m in models.json()["data"]] == ["demo"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "demo", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert "--disable-log-requests" in text          # the one line: it changes nothing here
        assert "Traceback" not in text, text[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
