"""Bad input gives a clear exception (its type, and a message that says what to do), and the
engine keeps serving correct tokens afterwards. Bad checkpoints and model ids fail at load."""
from __future__ import annotations

import json
import shutil

import pytest

from engine import (LLM, CheckpointMismatchError, EngineShutdownError, InvalidArgumentError,
                    ModelNotFoundError, ProbeSpec, PromptTooLongError, SamplingParams,
                    UnsupportedArchitectureError)
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


@pytest.mark.parametrize("call,param", [
    (lambda llm: llm.generate([""]), "prompt"),
    (lambda llm: llm.generate([[5, 512]]), "prompt"),
    (lambda llm: llm.generate([[5, 6]] * 2, [SamplingParams()] * 3), "sampling"),
    (lambda llm: llm.generate([[5, 6]], {"temperature": 0}), "sampling"),
    (lambda llm: llm.generate([[5, 6]], watch="yes"), "watch"),
    (lambda llm: llm.generate([[5, 6]], watch=ProbeSpec(layers=[99])), "watch.layers"),
    (lambda llm: llm.generate([[5, 6]], SamplingParams(stop_token_ids=[10 ** 6])),
     "stop_token_ids"),
    (lambda llm: llm.generate([[5] * MAX_MODEL_LEN]), "prompt"),
    (lambda llm: llm.read_kv_block(0, 0, 0, "q"), "which"),
], ids=["empty", "vocab", "count", "type", "watch-type", "watch-layer", "stop-ids", "too-long",
        "kv-which"])
def test_a_bad_argument_names_itself_by_type(llm, call, param):
    """The caller finds the argument in `param`, not by parsing the message."""
    with pytest.raises(InvalidArgumentError) as err:
        call(llm)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)        # `except ValueError` still catches it


def test_a_request_to_a_shut_down_engine_raises_engine_shutdown(qwen3_dir):
    small = LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=8)
    small.shutdown()
    with pytest.raises(EngineShutdownError):
        small.submit([5, 6], on_event=lambda ev: None)


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


# ---- SamplingParams: every field checked at construction, frozen after ---------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw,match", [
    (dict(temperature="0.5"), "temperature must be a number"),
    (dict(temperature=True), "temperature must be a number"),
    (dict(temperature=NAN), "temperature must be finite"),
    (dict(temperature=INF), "temperature must be finite"),
    (dict(top_p="0.5"), "top_p must be a number"),
    (dict(top_p=NAN), "top_p must be finite"),
    (dict(min_p=NAN), "min_p must be finite"),
    (dict(min_p=-INF), "min_p must be finite"),
    (dict(min_p=None), "min_p must be a number"),
    (dict(top_k=2 ** 70), r"top_k must be an integer in \[0, 2\*\*31\)"),
    (dict(top_k=True), "top_k must be an integer"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(seed="abc"), "seed must be None or an integer"),
    (dict(seed=2 ** 64), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=2 ** 63), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=-(2 ** 70)), r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=1.5), "seed must be None or an integer"),
    (dict(seed=False), "seed must be None or an integer"),
    (dict(max_tokens=True), "max_tokens must be a positive integer"),
    (dict(max_tokens=8.0), "max_tokens must be a positive integer"),
    (dict(min_tokens=True), "min_tokens must be an integer"),
    (dict(logprobs=True), "logprobs must be an integer"),
    (dict(logprobs=2.0), "logprobs must be an integer"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop=[5]), "stop must be a string or a list of strings"),
    (dict(stop=b"ab"), "stop must be a string or a list of strings"),
    (dict(stop=["ok", None]), "stop must be a string or a list of strings"),
    (dict(stop=[""]), "stop strings must be non-empty"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=["5"]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=b"ab"), "stop_token_ids must be a list of token ids"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_sampling_params_name_the_bad_field(kw, match):
    with pytest.raises(InvalidArgumentError, match=match) as err:
        SamplingParams(**kw)
    assert err.value.param == next(iter(kw))     # the field by name, whatever the message says


def test_sampling_params_normalise_lists_to_tuples_and_numbers_to_python():
    import numpy as np
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop="x",
                       stop_token_ids=[np.int64(7), 8], seed=np.int64(-5))
    assert p.stop == ("x",) and p.stop_token_ids == (7, 8)
    assert type(p.temperature) is float and type(p.top_k) is int and type(p.seed) is int
    assert type(p.stop_token_ids[0]) is int
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_sampling_params_are_frozen():
    import dataclasses
    p = SamplingParams(temperature=0.7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = NAN
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stop = [5]
    assert p.temperature == 0.7 and p.stop == ()


def test_sampling_params_checked_against_the_model_at_submission(llm, still_serving):
    prompt = random_prompts([5], seed=55)[0]
    with pytest.raises(ValueError, match=r"stop_token_ids .*\[0, 512\)"):
        llm.generate(prompt, SamplingParams(stop_token_ids=[3, 512], min_tokens=2, max_tokens=4))
    with pytest.raises(ValueError, match=r"stop_token_ids .*\[0, 512\)"):
        list(llm.stream(prompt, SamplingParams(stop_token_ids=[2 ** 40], max_tokens=4)))
    still_serving()


def test_extreme_but_valid_sampling_values_serve(llm, still_serving):
    """The int64 hash takes any seed in [-2**63, 2**63); a top_k above the vocabulary is off."""
    prompt = random_prompts([6], seed=56)[0]
    for kw in (dict(seed=2 ** 63 - 1), dict(seed=-(2 ** 63)), dict(top_k=2 ** 31 - 1, seed=3),
               dict(top_k=513, top_p=0.9, min_p=0.01, seed=4)):
        o = llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw))[0]
        assert len(o.token_ids) == 3 and all(0 <= t < 512 for t in o.token_ids)
    a = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True, top_k=2 ** 31 - 1,
                                            seed=9))[0].token_ids
    b = llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True, seed=9))[0].token_ids
    assert a == b        # top_k larger than the vocabulary keeps every token
    still_serving()


# ---- ProbeSpec: types at construction; layers and lens_top_k against the model -------------------

@pytest.mark.parametrize("kw,match", [
    (dict(layers="0"), "ProbeSpec.layers must be None or a list of layer indices"),
    (dict(layers=[0, 1.0]), "ProbeSpec.layers must be None or a list of layer indices"),
    (dict(layers=[True]), "ProbeSpec.layers must be None or a list of layer indices"),
    (dict(prefill_pattern_layers=None), "ProbeSpec.prefill_pattern_layers must be a list"),
    (dict(prefill_pattern_layers=["1"]), "ProbeSpec.prefill_pattern_layers must be a list"),
    (dict(lens_top_k=2.5), "ProbeSpec.lens_top_k must be an integer >= 1"),
    (dict(lens_top_k=0), "ProbeSpec.lens_top_k must be an integer >= 1"),
    (dict(lens_top_k=True), "ProbeSpec.lens_top_k must be an integer >= 1"),
    (dict(prefill_pattern_cap="512"), "ProbeSpec.prefill_pattern_cap must be an integer >= 1"),
    (dict(norms="yes"), "ProbeSpec.norms must be True or False"),
    (dict(attention=1), "ProbeSpec.attention must be True or False"),
], ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_probe_spec_names_the_bad_field(kw, match):
    from engine import ProbeSpec
    with pytest.raises(ValueError, match=match):
        ProbeSpec(**kw)


def test_probe_spec_resolves_negative_layers_python_style():
    from engine import ProbeSpec
    spec = ProbeSpec(layers=[0, -1, 2], prefill_pattern_layers=(-3, 1))
    assert spec.layers == (0, -1, 2)                     # lists become tuples (hashable)
    r = spec.resolve(num_layers=3, vocab_size=512)
    assert r.layers == (0, 2) and r.prefill_pattern_layers == (0, 1)
    assert r.lens_top_k == spec.lens_top_k and r.norms == spec.norms
    assert ProbeSpec().resolve(3, 512).layers is None    # None = every layer


@pytest.mark.parametrize("kw,match", [
    (dict(layers=(0, 3)), r"ProbeSpec.layers.* 3 .*\[-3, 3\)"),
    (dict(layers=(-4,)), r"ProbeSpec.layers.* -4 .*\[-3, 3\)"),
    (dict(prefill_pattern_layers=(7,)), r"ProbeSpec.prefill_pattern_layers.* 7 .*\[-3, 3\)"),
    (dict(lens_top_k=513), r"ProbeSpec.lens_top_k.*513.*vocabulary.*512"),
])
def test_probe_spec_that_does_not_fit_the_model_is_refused(llm, still_serving, kw, match):
    from engine import ProbeSpec
    with pytest.raises(ValueError, match=match):
        ProbeSpec(**kw).resolve(num_layers=3, vocab_size=512)
    prompt = random_prompts([5], seed=57)[0]
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=3), watch=ProbeSpec(**kw))
    with pytest.raises(ValueError, match=match):
        list(llm.stream(prompt, SamplingParams(max_tokens=3), watch=ProbeSpec(**kw)))
    still_serving()


def test_negative_probe_layer_records_the_last_layer(llm):
    from engine import ProbeSpec
    rid = "neg-layer"
    list(llm.stream(random_prompts([6], seed=58)[0],
                    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                    watch=ProbeSpec(layers=(0, -1), prefill_pattern_layers=(-1,)), request_id=rid))
    tr = llm.trace(rid)
    assert tr.attention and all(list(s.layers) == [0, 2] for s in tr.attention)
    assert list(tr.prefill_pattern) == [2]


def test_watch_must_be_a_probe_spec(llm):
    with pytest.raises(ValueError, match="watch must be a ProbeSpec or None"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2), watch={"layers": [0]})


# ---- prompts and chat messages ------------------------------------------------------------------

@pytest.mark.parametrize("messages,match", [
    ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
    ([{"role": "system", "content": "hi"}, {"role": "user", "content": 5}],
     r"messages\[1\]\.content must be a string"),
    ([{"role": "user", "content": ["hi"]}], r"messages\[0\]\.content must be a string"),
    ([{"role": None, "content": "hi"}], r"messages\[0\]\.role must be a string"),
    ([{"role": "user", "content": "hi"}, "hello"], r"messages\[1\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] needs 'role' and 'content'"),
], ids=["content-None", "content-int", "content-list", "role-None", "not-a-dict", "no-role"])
def test_bad_chat_message_names_the_field(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([messages], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=match):
        list(llm.stream(messages, SamplingParams(max_tokens=2)))


@pytest.mark.parametrize("prompts", [5, None, 2.5, {"role": "user"}, [None], [[1, "2"]], [[1.5]],
                                     [[True]]],
                         ids=["int", "None", "float", "dict", "list-of-None", "str-id",
                              "float-id", "bool-id"])
def test_bad_prompts_name_the_argument(llm, prompts):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompts, SamplingParams(max_tokens=2))


def test_generate_of_a_bare_int_names_prompts(llm):
    with pytest.raises(ValueError, match=r"prompts must be"):
        llm.generate(5, SamplingParams(max_tokens=2))


def test_a_single_conversation_is_one_prompt(llm):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    single = llm.generate(conv, sp)
    batch = llm.generate([conv], sp)
    streamed = [ev.token_id for ev in llm.stream(conv, sp)]
    assert len(single) == 1 and len(batch) == 1
    assert single[0].token_ids == batch[0].token_ids == streamed
    assert single[0].prompt_token_ids == batch[0].prompt_token_ids
