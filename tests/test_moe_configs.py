"""MoE launch configs: table files (names, loading, nearest token count, defaults), the dispatcher
in engine/layers/moe.py choosing the GEMV or grouped path on either side of a tuned threshold, and
bench/tune_moe.py writing tables the dispatcher then uses (CPU, Triton interpreter)."""
import json

import pytest
import torch

from engine.kernels import fused_moe as fm
from engine.kernels import moe_configs as mc
from engine.kernels.moe_configs import KernelTile, MoEGemvConfig, MoEKernelConfig
from engine.kernel_config import KernelConfig
from engine.kernels.moe_routing import route
from engine.layers import moe as moe_layer

E, K, H, I = 8, 2, 32, 16
GEMV = MoEGemvConfig(KernelTile(8, 16, 1), KernelTile(16, 16, 1))
GROUPED = MoEKernelConfig(16, KernelTile(16, 16, 4, 2), KernelTile(16, 16, 4, 2, group_m=2))
# CPU tensors through Triton: the interpreter, which tests/conftest.py turns on for the whole
# process before anything imports triton (never this module: import order must not matter)
pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    _, w, ids = route(torch.randn(n, E, generator=g), K, True)
    return x, w13, w2, w, ids


def _write(directory, configs: dict, name=None):
    name = name or mc.config_file_name(E, I, H, torch.float32, "cpu")
    mc.write_table(directory / name, {m: mc.config_to_dict(c) for m, c in configs.items()}, E=E, N=I, H=H)
    return directory / name


def test_file_name_follows_the_shape_dtype_and_device():
    assert mc.config_file_name(128, 768, 2048, torch.bfloat16, "NVIDIA H200") == \
        "moe_E=128_N=768_H=2048_bf16_NVIDIA_H200.json"
    assert mc.config_file_name(128, 384, 2048, torch.bfloat16, "NVIDIA H100 80GB HBM3") == \
        "moe_E=128_N=384_H=2048_bf16_NVIDIA_H100_80GB_HBM3.json"
    assert mc.device_name(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("cfg", [GEMV, GROUPED], ids=["gemv", "grouped"])
def test_config_round_trips_through_a_dict(cfg):
    d = mc.config_to_dict(cfg)
    assert d["path"] == cfg.path
    assert mc.config_from_dict(json.loads(json.dumps(dict(d, us=3.5)))) == cfg


@pytest.mark.parametrize("entry", [{"path": "dense", "w13": {}, "w2": {}},
                                   {"path": "gemv", "w13": {"block_n": 2}},
                                   {"path": "grouped", "w13": {"block_n": 2, "block_k": 8},
                                    "w2": {"block_n": 2, "block_k": 8}}])
def test_bad_config_entries_raise_value_error(entry):
    with pytest.raises(ValueError, match="bad MoE config entry"):
        mc.config_from_dict(entry)


def test_without_a_table_small_batches_take_gemv_and_large_ones_grouped():
    small = mc.pick_config(1, 8, 128, 768, 2048, torch.bfloat16, torch.device("cpu"))
    large = mc.pick_config(64, 8, 128, 768, 2048, torch.bfloat16, torch.device("cpu"))
    assert small.path == "gemv" and large.path == "grouped"
    assert mc.pick_config(mc.DEFAULT_GEMV_MAX_PAIRS // 8, 8, 128, 768, 2048, torch.bfloat16, None).path == "gemv"
    assert mc.pick_config(mc.DEFAULT_GEMV_MAX_PAIRS // 8 + 1, 8, 128, 768, 2048, torch.bfloat16, None).path \
        == "grouped"


def test_a_table_is_read_and_the_nearest_tuned_token_count_wins(tmp_path):
    other = MoEKernelConfig(32, KernelTile(32, 16), KernelTile(32, 16))
    _write(tmp_path, {1: GEMV, 8: GROUPED, 64: other})
    pick = lambda m: mc.pick_config(m, K, E, I, H, torch.float32, torch.device("cpu"), tmp_path)  # noqa: E731
    assert [pick(m) for m in (1, 4, 5, 8, 30, 40, 1000)] == [GEMV, GEMV, GROUPED, GROUPED, GROUPED, other, other]
    # another shape or dtype has no table: defaults; nor has the shipped directory this shape
    assert mc.pick_config(1, K, E, I, H, torch.float16, None, tmp_path) == mc.default_config(1, K, E, 2)
    assert mc.pick_config(1, K, E, I, H, torch.float32, torch.device("cpu")) == mc.default_config(1, K, E, 4)


def test_an_unreadable_table_names_the_file(tmp_path):
    path = tmp_path / mc.config_file_name(E, I, H, torch.float32, "cpu")
    path.write_text('{"configs": {"1": {"path": "gemv"}}}')
    with pytest.raises(ValueError, match="unreadable"):
        mc.pick_config(1, K, E, I, H, torch.float32, torch.device("cpu"), tmp_path)


def _spy(monkeypatch):
    calls = []
    gemv, grouped = moe_layer.fused_moe_gemv, fm.fused_moe

    def spy_gemv(*a, **k):
        calls.append("gemv")
        return gemv(*a, **k)

    def spy_grouped(*a, **k):
        calls.append("grouped")
        return grouped(*a, **k)
    monkeypatch.setattr(moe_layer, "fused_moe_gemv", spy_gemv)
    monkeypatch.setattr(fm, "fused_moe", spy_grouped)
    return calls


@pytest.mark.parametrize("n,path", [(1, "gemv"), (3, "gemv"), (6, "grouped"), (11, "grouped")])
def test_dispatcher_takes_the_tuned_path_on_each_side_of_the_threshold(n, path, tmp_path, monkeypatch):
    _write(tmp_path, {1: GEMV, 8: GROUPED})  # the split falls between 4 and 5 tokens
    calls = _spy(monkeypatch)
    x, w13, w2, w, ids = _inputs(n, seed=n)
    got = moe_layer.fused_experts(x, w13, w2, w, ids, kernels=KernelConfig(moe_config_dir=tmp_path))
    assert calls == [path]
    torch.testing.assert_close(got, fm.fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)


def test_dispatcher_follows_an_explicit_config(monkeypatch):
    calls = _spy(monkeypatch)
    x, w13, w2, w, ids = _inputs(2, seed=5)
    a = moe_layer.fused_experts(x, w13, w2, w, ids, config=GROUPED)
    b = moe_layer.fused_experts(x, w13, w2, w, ids, config=GEMV)
    assert calls == ["grouped", "gemv"]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tuner_smoke_writes_a_table_the_dispatcher_uses(tmp_path, monkeypatch):
    from bench import tune_moe
    out = tmp_path / "cfg"
    res = tune_moe.main(["--smoke", "--tp", "1", "--m", "1", "40", "--out-dir", str(out)])
    sm = tune_moe.SMOKE
    name = mc.config_file_name(sm["E"], sm["I"], sm["H"], torch.float32, "cpu")
    assert [p.name for p in out.iterdir()] == [name]
    raw = json.loads((out / name).read_text())
    assert set(raw["configs"]) == {"1", "40"} and raw["tp"] == 1
    one, forty = raw["configs"]["1"], raw["configs"]["40"]
    assert "gemv_us" in one and "grouped_us" in one   # both paths measured at M=1 ...
    assert "gemv_us" not in forty and forty["path"] == "grouped"   # ... only grouped past gemv_max_m
    assert all(e["verified"] and e["rel_err"] < tune_moe.TOL for e in raw["configs"].values())
    assert res["tables"]["1"][1]["path"] == one["path"]
    table = mc.load_table(str(out / name))
    assert [m for m, _ in table] == [1, 40]
    # the engine reads it from its KernelConfig's table directory
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, sm["H"], generator=g)
    w13 = torch.randn(sm["E"], 2 * sm["I"], sm["H"], generator=g) / sm["H"] ** 0.5
    w2 = torch.randn(sm["E"], sm["H"], sm["I"], generator=g) / sm["I"] ** 0.5
    _, w, ids = route(torch.randn(1, sm["E"], generator=g), sm["top_k"], True)
    calls = _spy(monkeypatch)
    got = moe_layer.fused_experts(x, w13, w2, w, ids, kernels=KernelConfig(moe_config_dir=out))
    assert calls == [one["path"]]
    torch.testing.assert_close(got, fm.fused_moe_ref(x, w13, w2, w, ids), rtol=1e-5, atol=1e-5)
