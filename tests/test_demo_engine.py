"""The demo checkpoints run in our engine exactly as in HF, and pass the quality bar there."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, ProbeSpec, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import demo_data as dd  # noqa: E402

DEMOS = {"dense": ROOT / "assets" / "demo-qwen3", "moe": ROOT / "assets" / "demo-qwen3-moe"}


def _prompts(n_per_task: int, seed: int):
    return [(task, m, a) for task in dd.GRADED_TASKS
            for m, a in dd.held_out_prompts(task, n_per_task, seed=seed)]


@pytest.fixture(scope="module", params=sorted(DEMOS))
def demo(request):
    path = DEMOS[request.param]
    if not (path / "model.safetensors").exists():
        pytest.skip(f"{path} is missing: run tools/train_demo.py")
    llm = LLM(str(path), device="cpu", num_kv_blocks=256)
    yield request.param, path, llm
    llm.shutdown()


def test_engine_greedy_tokens_equal_hf(demo):
    from transformers import AutoModelForCausalLM
    name, path, llm = demo
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    items = _prompts(2, seed=11)
    sp = SamplingParams(temperature=0, max_tokens=12)
    outs = llm.generate([m for _, m, _ in items], sp)
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=sorted(llm.eos_token_ids), pad_token_id=0)
        ref = ref[0, ids.shape[1]:].tolist()
        assert o.token_ids == ref[:len(o.token_ids)] and len(o.token_ids) == len(ref), name


def test_quality_bar_through_our_engine(demo):
    name, _, llm = demo
    items = _prompts(8, seed=5)
    outs = llm.generate([m for _, m, _ in items], SamplingParams(temperature=0, max_tokens=40))
    right = sum(dd.check_answer(t, o.text, a) for (t, _, a), o in zip(items, outs))
    assert right / len(items) >= 0.9, f"{name}: {right}/{len(items)}"


def test_moe_demo_routing_is_recorded(demo):
    name, _, llm = demo
    if name != "moe":
        pytest.skip("dense model")
    (m, _), = dd.held_out_prompts("add", 1, seed=2)
    out = llm.generate([m], SamplingParams(temperature=0, max_tokens=6), watch=ProbeSpec())[0]
    probs, ids, w = llm.trace(out.request_id).routing()
    assert probs.shape[1:] == (4, 8) and ids.shape[-1] == 2
    # rows served by the prefix cache were never computed: NaN by design
    assert abs(float(np.nanmean(w.sum(-1))) - 1.0) < 1e-5      # norm_topk_prob
