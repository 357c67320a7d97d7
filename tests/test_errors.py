"""Bad input gives a clear exception (its type, and a message that says what to do), and the
engine keeps serving correct tokens afterwards. Bad checkpoints and model ids fail at load."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import (LLM, CheckpointMismatchError, ModelNotFoundError, PromptTooLongError,
                    SamplingParams, UnsupportedArchitectureError)
from test_generate_vs_hf import hf_greedy, random_prompts

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, device="cpu", block_size=4, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def still_serving(llm, qwen3_dir):
    """Check that the engine still answers a prompt with HF's greedy tokens."""
    prompt = random_prompts([9], seed=51)[0]
    expected = hf_greedy(qwen3_dir, [prompt], 6)[0][0]

    def check():
        o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert o[0].token_ids == expected
    return check


# ---- requests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", []], ids=["empty-string", "empty-token-list"])
def test_empty_prompt_is_rejected(llm, still_serving, prompt):
    with pytest.raises(ValueError, match="prompt is empty.*at least one"):
        llm.generate([prompt], SamplingParams(max_tokens=4))
    still_serving()


@pytest.mark.parametrize("length", [MAX_MODEL_LEN, MAX_MODEL_LEN + 30])
def test_prompt_over_max_model_len_is_rejected(llm, still_serving, length):
    prompt = random_prompts([length], seed=52)[0]
    with pytest.raises(PromptTooLongError) as err:
        llm.generate(prompt, SamplingParams(max_tokens=4))
    msg = str(err.value)
    assert str(length) in msg and "max_model_len" in msg and "shorten the prompt" in msg
    still_serving()


def test_prompt_that_can_never_fit_the_kv_cache_is_rejected(qwen3_dir):
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=3) as small:   # 12 slots
        with pytest.raises(PromptTooLongError, match="num_kv_blocks"):
            small.generate(random_prompts([12], seed=53)[0], SamplingParams(max_tokens=4))
        o = small.generate(random_prompts([11], seed=54)[0],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        assert (len(o.token_ids), o.finish_reason) == (1, "length")


def test_token_id_outside_the_vocabulary_is_rejected(llm, still_serving):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        llm.generate([[5, 512, 7]], SamplingParams(max_tokens=4))
    still_serving()


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(max_tokens=-3), "max_tokens must be a positive integer"),
    (dict(temperature=-0.5), r"temperature must be >= 0 \(0 = greedy\)"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_p=-0.2), r"top_p must be in \(0, 1\]"),
], ids=["max_tokens=0", "max_tokens<0", "temperature<0", "top_p=0", "top_p>1", "top_p<0"])
def test_invalid_sampling_params_are_rejected(llm, still_serving, kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    still_serving()


# ---- checkpoints and model ids ------------------------------------------------------------------

def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite_tensors(path: str, edit) -> None:
    from safetensors.torch import load_file, save_file
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture_is_rejected(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "llama")
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LlamaForCausalLM"]
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedArchitectureError) as err:
        LLM(path, device="cpu")
    msg = str(err.value)
    assert "LlamaForCausalLM" in msg and "Qwen3ForCausalLM" in msg and "supported" in msg


def test_checkpoint_missing_a_tensor_names_it(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "missing")
    name = "model.layers.1.self_attn.o_proj.weight"
    _rewrite_tensors(path, lambda t: t.pop(name))
    with pytest.raises(CheckpointMismatchError, match=f"missing.*{name}"):
        LLM(path, device="cpu")


def test_checkpoint_missing_one_piece_of_a_fused_tensor_names_it(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "missing_k")
    _rewrite_tensors(path, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointMismatchError) as err:
        LLM(path, device="cpu")
    msg = str(err.value)
    assert "model.layers.2.self_attn" in msg and "'k'" in msg and "q'" not in msg


def test_checkpoint_with_an_unexpected_tensor_names_it(qwen3_dir, tmp_path):
    import torch
    path = _copy(qwen3_dir, tmp_path / "extra")
    name = "model.layers.0.mlp.surprise.weight"
    _rewrite_tensors(path, lambda t: t.__setitem__(name, torch.randn(4, 4)))
    with pytest.raises(CheckpointMismatchError, match=f"unexpected.*{name}"):
        LLM(path, device="cpu")


def test_hub_id_offline_says_to_pass_a_local_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))           # an empty cache
    import huggingface_hub.constants as hub
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)        # read at import time
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="pass its local directory"):
        LLM("glassbox-test/no-such-model", device="cpu")


def test_missing_local_directory_says_what_to_pass(tmp_path):
    with pytest.raises(ModelNotFoundError, match="local checkpoint directory"):
        LLM(str(tmp_path / "nowhere"), device="cpu")
