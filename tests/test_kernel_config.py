"""KernelConfig (engine/kernel_config.py): the kernel choices are settled once per engine, from
EngineConfig(kernels=...) first, then the GLASSBOX_* environment, then the defaults; bad names
and values are refused with the field named; a value set after `import engine` reaches the next
engine (the old switches were read at import); every layer and every TP rank runs with the
runner's one config; and each kept switch's non-default side still matches the torch reference
(CPU, Triton interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import engine  # noqa: F401  — imported before any variable below is set: the old bug's order
from engine.config import EngineConfig
from engine.errors import InvalidArgumentError
from engine.kernel_config import DEFAULT_KERNELS, KernelConfig
from engine.runtime import build_runner

ENV = {f.name: f.metadata["env"] for f in dataclasses.fields(KernelConfig)}


def _cfg(**kernels):
    return EngineConfig(model="unused", device="cpu", kernels=kernels or None)


def test_defaults_without_overrides_or_environment():
    k = KernelConfig.build(_cfg(), environ={})
    assert k == DEFAULT_KERNELS == KernelConfig()
    assert (k.pdl, k.prefill_graphs, k.attn_context_caps, k.moe_config_dir) == \
        (True, True, (256, 512, 1024, 2048), None)


def test_overrides_win_over_the_environment_which_wins_over_defaults(tmp_path):
    environ = {ENV["pdl"]: "0", ENV["prefill_graphs"]: "0", ENV["attn_context_caps"]: "512,256",
               ENV["moe_config_dir"]: str(tmp_path)}
    from_env = KernelConfig.build(_cfg(), environ=environ)
    assert (from_env.pdl, from_env.prefill_graphs, from_env.attn_context_caps,
            from_env.moe_config_dir) == (False, False, (256, 512), str(tmp_path))
    both = KernelConfig.build(_cfg(pdl=True, attn_context_caps=[]), environ=environ)
    assert both.pdl is True and both.attn_context_caps == ()            # overrides
    assert both.prefill_graphs is False and both.moe_config_dir == str(tmp_path)   # environment
    # an empty caps variable means no bounded graphs, as it always did
    assert KernelConfig.build(_cfg(), environ={ENV["attn_context_caps"]: ""}).attn_context_caps == ()


def test_every_choice_is_documented_with_its_environment_name():
    for row in DEFAULT_KERNELS.describe():
        assert row["env"].startswith("GLASSBOX_") and len(row["why"]) > 40, row
        assert row["value"] == row["default"]


def test_an_unknown_name_is_refused_listing_the_valid_ones():
    with pytest.raises(InvalidArgumentError) as e:
        _cfg(merge_heads=False)
    assert e.value.param == "kernels"
    assert "'merge_heads' is not a kernel choice" in str(e.value)
    for name in KernelConfig.names():
        assert name in str(e.value)
    with pytest.raises(InvalidArgumentError, match="must be a dict"):
        EngineConfig(model="unused", device="cpu", kernels=["pdl"])


@pytest.mark.parametrize("name,value,says", [
    ("pdl", 2, "must be true or false"),
    ("pdl", "maybe", "must be true or false"),
    ("prefill_graphs", None, "must be true or false"),
    ("attn_context_caps", [256, 0], "positive token counts"),
    ("attn_context_caps", [256, True], "positive token counts"),
    ("attn_context_caps", 512, "list of positive token counts"),
    ("moe_config_dir", "/no/such/glassbox/dir", "is not a directory"),
])
def test_a_bad_value_is_refused_naming_the_field(name, value, says):
    with pytest.raises(InvalidArgumentError, match=says) as e:
        _cfg(**{name: value})
    assert e.value.param == f"kernels.{name}" and f"kernels['{name}']" in str(e.value)
    with pytest.raises(InvalidArgumentError, match=says):     # built by hand: the same checks
        KernelConfig(**{name: value})


def test_a_bad_environment_value_is_refused_naming_the_variable():
    with pytest.raises(InvalidArgumentError, match="GLASSBOX_PDL='maybe'.*must be true or false"):
        KernelConfig.build(_cfg(), environ={ENV["pdl"]: "maybe"})
    # an override for that name means the variable is never read
    assert KernelConfig.build(_cfg(pdl=False), environ={ENV["pdl"]: "maybe"}).pdl is False


def _layers_with_kernels(model) -> list:
    return [m for m in model.modules() if hasattr(m, "kernels")]


def test_a_variable_set_after_import_engine_reaches_the_next_engine(qwen3_dir, monkeypatch):
    """The old switches were module globals read when `engine` was imported: setting one later
    did nothing. Now the engine reads them when it is built."""
    from engine import LLM
    monkeypatch.setenv(ENV["attn_context_caps"], "128")
    monkeypatch.setenv(ENV["pdl"], "off")
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=16) as llm:
        k = llm.runner.kernel_config
        assert (k.attn_context_caps, k.pdl) == ((128,), False)
        layers = _layers_with_kernels(llm.runner.model)
        assert len(layers) > 10 and all(m.kernels is k for m in layers)
    monkeypatch.delenv(ENV["pdl"])
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=16) as llm:
        assert llm.runner.kernel_config.pdl is True


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe"])
def test_engine_config_kernels_reach_the_runner_and_every_layer(model_factory, arch):
    """The path LLM(..., kernels=...) takes: EngineConfig alone carries the choices."""
    from transformers import AutoConfig
    path = model_factory(arch)
    cfg = EngineConfig(model=path, device="cpu", kernels={"pdl": False, "attn_context_caps": [64]})
    runner = build_runner(cfg, AutoConfig.from_pretrained(path), path, 64)
    try:
        k = runner.kernel_config
        assert (k.pdl, k.attn_context_caps) == (False, (64,))
        layers = _layers_with_kernels(runner.model)
        kinds = {type(m).__name__ for m in layers}
        assert {"RMSNorm", "Attention", "QKVParallelLinear", "RowParallelLinear",
                "ParallelLMHead"} <= kinds
        if arch == "qwen2_moe":
            assert "FusedMoE" in kinds
        assert all(m.kernels is k for m in layers)
    finally:
        runner.shutdown()


def test_tp_workers_run_rank0s_config_not_their_environment(qwen3_dir, monkeypatch):
    """A worker gets the driver's KernelConfig with its start-up arguments: an environment that
    would not even parse is never read there (a worker that built its own would die)."""
    from transformers import AutoConfig
    monkeypatch.setenv(ENV["pdl"], "not-a-bool")
    given = KernelConfig(pdl=False, attn_context_caps=(512,))
    cfg = EngineConfig(model=qwen3_dir, device="cpu", tensor_parallel_size=2)
    runner = build_runner(cfg, AutoConfig.from_pretrained(qwen3_dir), qwen3_dir, 64,
                          kernel_config=given)
    try:
        assert runner.kernel_config is given and runner.local.kernel_config is given
        runner.check_workers()
    finally:
        runner.shutdown()


def test_kept_switches_off_give_the_default_engines_tokens(qwen3_dir, monkeypatch):
    """Every kept switch on its non-default side, one CPU engine against the default one: the
    same greedy tokens (the CPU runs the torch paths; the kernels' sides are checked below)."""
    from engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=32) as llm:
        want = [o.token_ids for o in llm.generate(prompts, sp)]
    for name, value in (("pdl", "0"), ("prefill_graphs", "0"), ("attn_context_caps", "")):
        monkeypatch.setenv(ENV[name], value)
    with LLM(qwen3_dir, device="cpu", block_size=4, num_kv_blocks=32) as llm:
        assert llm.runner.kernel_config == KernelConfig(pdl=False, prefill_graphs=False,
                                                        attn_context_caps=())
        assert [o.token_ids for o in llm.generate(prompts, sp)] == want


# ---- each kept switch's non-default side in the kernels, against the torch references -----------

def test_launchers_with_pdl_off_match_their_references(triton_interpreter):
    """pdl=False (KernelConfig.pdl off) through every launcher that takes it."""
    from engine.kernels.activation import silu_and_mul, silu_and_mul_ref
    from engine.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref
    from engine.kernels.skinny_gemm import (rms_norm_linear, rms_norm_linear_ref, skinny_linear,
                                            skinny_linear_ref)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
    nw, w = torch.randn(64, generator=g) + 1, torch.randn(48, 64, generator=g) / 8
    torch.testing.assert_close(silu_and_mul(x, pdl=False), silu_and_mul_ref(x))
    for got, want in zip(fused_add_rms_norm(x, r, nw, 1e-6, pdl=False),
                         fused_add_rms_norm_ref(x, r, nw, 1e-6)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(skinny_linear(x, w, pdl=False), skinny_linear_ref(x, w),
                               rtol=1e-5, atol=1e-5)
    got = rms_norm_linear(x[:1], w, nw, 1e-6, r[:1], factored=True, pdl=False)
    want = rms_norm_linear_ref(x[:1], w, nw, 1e-6, r[:1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[1], want[1])


def test_attention_with_pdl_off_and_a_context_cap_matches_the_reference(triton_interpreter):
    """attn_context_caps: the bounds that launch fewer splits come from the config's caps (none
    from an empty one), and attention bounded by one (max_context, as its graph replays it)
    matches the reference for contexts within it; with pdl=False."""
    from engine.kernels import decode_attention as DA
    cpu = torch.device("cpu")
    width, page, hkv, hq, d = 64, 4, 2, 4, 32       # a 256-token table
    assert DA.context_caps(1, hkv, width * page, cpu, ()) == []
    caps = DA.context_caps(1, hkv, width * page, cpu, (64, 128, 256, 512))
    assert caps and all(c < width * page for c in caps)
    full = DA.choose_num_splits(1, hkv, width * page, cpu)
    assert all(DA.choose_num_splits(1, hkv, c, cpu) < full for c in caps)
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(2 * width, page, hkv, d, generator=g)
    v_cache = torch.randn(2 * width, page, hkv, d, generator=g)
    tables = torch.randperm(2 * width, generator=g)[:2 * width].view(2, width).int()
    for cap in caps:
        ctx = torch.tensor([cap, cap // 2 + 1], dtype=torch.int32)
        q = torch.randn(2, hq, d, generator=g)
        out = DA.paged_decode_attention(q, k_cache, v_cache, tables, ctx, d ** -0.5,
                                        max_context=cap, pdl=False)
        ref = DA.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, d ** -0.5)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
