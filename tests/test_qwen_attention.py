"""The Qwen attention block: one rotary cos/sin table per model (shared by every layer, so model
memory beyond the weights does not grow with depth), and the GPU's fused path (q/k norm + RoPE +
K/V store in one launch), run here in Triton's interpreter, gives HF's tokens, logprobs and
attention rows like the CPU path does."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ProbeSpec
from engine.kernels import qk_norm_rope_store, rmsnorm, rotary, store_kvcache
from engine.models import qwen
from engine.models.registry import model_class
from test_generate_vs_hf import (PROMPT_LENS, assert_same_as_hf, greedy_params, hf_greedy,
                                 random_prompts)
from test_probes import assert_attention_matches, greedy, hf_run, processed, prompt
from tiny_models import load_hf, make_config


def tensors_reachable(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and plain tensor attributes of every module (a table kept as an
    attribute counts too)."""
    out = []
    for m in model.modules():
        out += [t for t in m._parameters.values() if t is not None]
        out += [t for t in m._buffers.values() if t is not None]
        out += [t for t in vars(m).values() if isinstance(t, torch.Tensor)]
    return out


def bytes_beyond_weights(model: torch.nn.Module, skip: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of distinct storages the model holds, less its parameters and `skip` (KV cache)."""
    skip_ptrs = {t.untyped_storage().data_ptr() for t in skip}
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors_reachable(model)}
    return sum(n for ptr, n in storages.items() if ptr not in param_ptrs | skip_ptrs)


# ---- one rotary table per model -----------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_every_layer_shares_one_rotary_table_after_the_runner_moves_it(model_factory, arch):
    with LLM(model_factory(arch), device="cpu", num_kv_blocks=16) as llm:
        model = llm.runner.model
        tables = [layer.self_attn.rotary_emb.cos_sin_cache for layer in model.model.layers]
        assert len(tables) == llm.hf_config.num_hidden_layers > 1
        assert {t.data_ptr() for t in tables} == {model.model.rotary_emb.cos_sin_cache.data_ptr()}
        assert tables[0].dtype == torch.float32
        assert tables[0].shape == (llm.runner.max_model_len + llm.block_size, llm.runner.head_dim)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_model_memory_beyond_the_weights_does_not_grow_with_layers(arch):
    """Built as the runner builds it (fp32 default dtype on the CPU): whatever the depth, the
    only non-weight storage is one [max_positions, D] fp32 table."""
    max_positions = 4096
    extra = {}
    for layers in (2, 8):
        config = make_config(arch, num_hidden_layers=layers)
        model = model_class(config)(config, max_positions)
        extra[layers] = bytes_beyond_weights(model)
    table = max_positions * qwen.head_dim_of(config) * 4
    assert extra == {2: table, 8: table}


def test_engine_memory_beyond_weights_and_kv_cache_is_one_table_at_any_depth(model_factory):
    extra = {}
    for layers in (2, 6):
        with LLM(model_factory("qwen3", num_hidden_layers=layers), device="cpu",
                 num_kv_blocks=16) as llm:
            runner = llm.runner
            table = (runner.max_model_len + llm.block_size) * runner.head_dim * 4
            extra[layers] = bytes_beyond_weights(runner.model, skip=(runner.kv_cache,))
    assert extra == {2: table, 6: table}


# ---- the fused GPU path, run by the interpreter on the CPU --------------------------------------
@pytest.fixture
def fused_path(monkeypatch):
    """Route the CPU engine through the fused kernel; count the calls it replaces (q/k norm
    on head rows, rotary, K/V store) and its own."""
    calls = {"fused": 0, "qk_norm": 0, "rotary": 0, "store": 0}
    head_dim = 16  # tiny_models: hidden 64 over 4 heads; residual norms see 64-wide rows

    def counting(name, fn):
        def wrapped(*a, **kw):
            if name != "qk_norm" or a[0].shape[-1] == head_dim:
                calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(qwen, "fused_qkv_path", lambda qkv: True)
    monkeypatch.setattr(qk_norm_rope_store, "qk_norm_rope_store",
                        counting("fused", qk_norm_rope_store.qk_norm_rope_store))
    for mod, name, key in ((rmsnorm, "rms_norm_ref", "qk_norm"), (rmsnorm, "rms_norm", "qk_norm"),
                           (rotary, "apply_rotary_ref", "rotary"), (rotary, "apply_rotary", "rotary"),
                           (store_kvcache, "store_kvcache_cpu", "store"),
                           (store_kvcache, "store_kvcache", "store")):
        monkeypatch.setattr(mod, name, counting(key, getattr(mod, name)))
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_fused_path_matches_hf_with_one_launch_per_layer(model_factory, fused_path, arch):
    """Batched prompts, chunked prefill and small blocks; per layer and step the fused kernel
    is the only q/k-norm / RoPE / store call (qwen2: bias, no q/k norm)."""
    path = model_factory(arch)
    prompts = random_prompts(PROMPT_LENS, seed=1234)
    refs = hf_greedy(path, prompts)
    with LLM(path, device="cpu", block_size=4, max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, greedy_params())
        steps = len(llm.inspect().steps)
        layers = llm.hf_config.num_hidden_layers
    assert_same_as_hf(outs, refs)
    # the trace keeps at most its recent steps; the engine ran at least that many forwards
    assert fused_path["fused"] >= layers * steps and fused_path["fused"] % layers == 0
    assert fused_path["qk_norm"] == fused_path["rotary"] == fused_path["store"] == 0


def test_fused_path_keeps_the_attention_probe_rows_equal_to_hf(model_factory, fused_path):
    path = model_factory("qwen3")
    with LLM(path, device="cpu", block_size=4, num_kv_blocks=96) as llm:
        out = llm.generate([prompt(1, 6)], greedy(7), watch=ProbeSpec(prefill_pattern_layers=(0,)))[0]
        trace = llm.trace(out.request_id)
    assert fused_path["fused"] > 0
    assert_attention_matches(trace, hf_run(load_hf(path), processed(trace)), len(out.token_ids))
