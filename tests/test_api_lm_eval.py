"""lm-eval-harness' `local-completions` model runs a small multiple-choice task end to end
against the server (batched loglikelihood requests: echo + logprobs on token-id prompts), and
every score it gets equals HF's forward of the demo checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from api_served import DEMO, KEY

QUESTIONS = [
    {"question": "The quick brown fox jumps over the lazy", "choices": ["dog", "cat", "sun"],
     "answer": 0},
    {"question": "one two three four", "choices": ["five", "nine", "blue"], "answer": 0},
    {"question": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0},
]
TASK = """task: glassbox_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _hf_loglikelihood(hf, tok, context: str, continuation: str) -> float:
    """lm-eval's own split of (context, continuation) into tokens, scored by HF."""
    whole = tok.encode(context + continuation)
    ctx = tok.encode(context)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    return sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_local_completions_multiple_choice(served, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from tiny_models import load_hf
    data = tmp_path / "mc.jsonl"
    data.write_text("\n".join(json.dumps(q) for q in QUESTIONS))
    (tmp_path / "glassbox_tiny_mc.yaml").write_text(TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={served.model},base_url={served.url}/v1/completions,"
                   f"tokenizer={DEMO},tokenizer_backend=huggingface,num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True",
        tasks=["glassbox_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path),
                                                           include_defaults=False),
        batch_size=4, log_samples=True, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    samples = out["samples"]["glassbox_tiny_mc"]
    assert len(samples) == len(QUESTIONS)
    hf, tok = load_hf(DEMO), served.llm.tokenizer
    for s in samples:
        doc = s["doc"]
        got = [r[0] for r in s["resps"]]             # (loglikelihood, is_greedy) per choice
        for (ll, _), choice in zip(got, doc["choices"]):
            want = _hf_loglikelihood(hf, tok, doc["question"], " " + choice)
            assert abs(ll - want) < 1e-3, (doc, choice, ll, want)
        best = max(range(len(got)), key=lambda i: got[i][0])
        assert s["acc"] == float(best == doc["answer"])
    assert 0.0 <= out["results"]["glassbox_tiny_mc"]["acc,none"] <= 1.0
