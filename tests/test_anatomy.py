"""engine/anatomy against independent sources: parameter counts against the checkpoint's
tensors and HF's num_parameters(), shapes against the engine's modules and HF's activations,
kernels claimed per stage against the kernels that run, KV regions against the cache tensor's
own addressing and read_kv_block, per-rank slices against layers built at that TP degree."""
from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.anatomy import (PUBLISHED, architecture_of_config, model_anatomy, parse_ids,
                            published_rows, read_kv_cache_bytes, tokenize)
from engine.anatomy.tensor_parallel import tp_plan
from engine.anatomy.weights import weight_breakdown
from engine.models.registry import model_class
from engine.parallel_state import TPGroup, use_tp
from tiny_models import load_hf

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),                          # q/k/v bias, no q/k norm
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),                  # shared expert + gate, layer 1 dense
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5, 6, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(model_factory):
    """One TP=1 engine per tiny architecture, built on first use."""
    built: dict[str, tuple[str, LLM]] = {}

    def get(name: str):
        if name not in built:
            arch, kw = ARCHS[name]
            path = model_factory(arch, **kw)
            built[name] = (path, LLM(path, num_kv_blocks=32, block_size=4))
        return built[name]
    yield get
    for _, llm in built.values():
        llm.shutdown()


def checkpoint_tensors(path: str) -> dict[str, int]:
    out = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                out[k] = int(np.prod(st.get_slice(k).get_shape()))
    return out


def group_of(name: str) -> str:
    """Checkpoint tensor name -> part group, written from HF's names (not the engine's)."""
    if "embed_tokens" in name:
        return "embedding"
    if name.startswith("lm_head"):
        return "lm head"
    if name == "model.norm.weight":
        return "final norm"
    if "layernorm" in name or "q_norm" in name or "k_norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    for frag, group in ((".mlp.experts.", "experts"), (".mlp.shared_expert_gate", "shared gate"),
                        (".mlp.shared_expert.", "shared expert"), (".mlp.gate.", "router"),
                        (".mlp.", "mlp")):
        if frag in name:
            return group
    raise AssertionError(f"unclassified tensor {name}")


# ---- parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ARCHS))
def test_parameter_counts_match_checkpoint_tensors_and_hf(engines, name):
    path, llm = engines(name)
    a = model_anatomy(llm)
    tensors = checkpoint_tensors(path)
    if a.arch.tied:
        tensors.pop("lm_head.weight", None)          # one tensor, counted once
    assert a.weights.total_params == sum(tensors.values()) == load_hf(path).num_parameters()
    groups: dict[str, int] = {}
    for k, n in tensors.items():
        groups[group_of(k)] = groups.get(group_of(k), 0) + n
    got = {g: n for g, n in a.weights.by_group().items() if n}
    assert got == groups
    assert llm.num_params == a.rank0_params == a.weights.total_params
    # bytes: what the loaded tensors really occupy
    assert a.weights.total_bytes == sum(p.numel() * p.element_size()
                                        for p in llm.runner.model.parameters())


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_active_params_count_top_k_of_the_experts(engines, name):
    path, llm = engines(name)
    a = model_anatomy(llm)
    cfg = llm.hf_config
    experts = sum(n for k, n in checkpoint_tensors(path).items() if ".mlp.experts." in k)
    unused = experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    assert a.weights.active_params == a.weights.total_params - unused
    assert a.weights.active_params < a.weights.total_params


@pytest.mark.parametrize("name", list(ARCHS))
def test_architecture_read_from_modules_equals_the_config_rules(engines, name):
    _, llm = engines(name)
    a = model_anatomy(llm).arch
    assert a == architecture_of_config(llm.hf_config, a.name)
    layers = llm.runner.model.model.layers
    assert a.mlp_kinds == tuple("moe" if hasattr(x.mlp, "experts") else "dense" for x in layers)


# ---- shapes ----------------------------------------------------------------------------------

def stage(stages, key):
    return next(s for s in stages if s.key == key)


@pytest.mark.parametrize("name", list(ARCHS))
def test_path_shapes_match_the_engine_modules(engines, name):
    _, llm = engines(name)
    a = model_anatomy(llm)
    p, m = a.path, llm.runner.model
    h = a.arch.hidden_size
    assert tuple(m.model.embed_tokens.weight.shape) == (a.arch.vocab_size, h)
    assert stage(p.outer, "embed").shape == (h,) and stage(p.outer, "layers").shape == (h,)
    assert stage(p.outer, "lm_head").shape == (m.lm_head.weight.shape[0],)
    attn = m.model.layers[0].self_attn
    assert stage(p.attention, "qkv_proj").shape == (attn.qkv_proj.weight.shape[0],)
    assert stage(p.attention, "q").shape == (attn.num_heads, attn.head_dim)
    assert stage(p.attention, "kv").shape == (2, attn.num_kv_heads, attn.head_dim)
    assert stage(p.attention, "concat").shape == (attn.o_proj.weight.shape[1],)
    assert stage(p.attention, "o_proj").shape == (attn.o_proj.weight.shape[0],)
    # every query head's KV head, as the attention kernels index it (h // group)
    assert [q // (attn.num_heads // attn.num_kv_heads) for grp in p.gqa for q in grp] == \
        [j for j, grp in enumerate(p.gqa) for _ in grp]
    for i in p.dense_layers:
        mlp = m.model.layers[i].mlp
        assert stage(p.mlp, "gate_up_proj").shape == (2, mlp.gate_up_proj.weight.shape[0] // 2)
        assert stage(p.mlp, "down_proj").shape == (mlp.down_proj.weight.shape[0],)
    for i in p.moe_layers:
        mlp = m.model.layers[i].mlp
        e, two_i, hh = mlp.experts.w13.shape
        assert stage(p.moe, "router").shape == (mlp.gate.weight.shape[0],) == (e,)
        assert stage(p.moe, "experts").shape == (mlp.experts.top_k, two_i // 2)
        assert stage(p.moe, "moe_block").shape == (hh,)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen2_moe"])
def test_path_shapes_match_hf_activations(engines, name):
    """One token's tensor at each stage has the shape HF's forward gives it."""
    path, llm = engines(name)
    p = model_anatomy(llm).path
    hf = load_hf(path)
    seen = {}
    hook = {
        "embed": hf.model.embed_tokens, "final_norm": hf.model.norm, "lm_head": hf.lm_head,
        "q": hf.model.layers[0].self_attn.q_proj, "k": hf.model.layers[0].self_attn.k_proj,
        "o_proj": hf.model.layers[0].self_attn.o_proj,
    }
    if p.mlp:
        dense = hf.model.layers[p.dense_layers[0]].mlp
        hook.update(gate=dense.gate_proj, act=dense.act_fn, down_proj=dense.down_proj)

    def record(key):
        def hook_fn(_module, _inputs, out):         # returns None: the output is unchanged
            seen.setdefault(key, tuple(out.shape[2:]))
        return hook_fn
    handles = [mod.register_forward_hook(record(k)) for k, mod in hook.items()]
    with torch.no_grad():
        hf(torch.tensor([[5, 6, 7]]))
    for hd in handles:
        hd.remove()
    for key in ("embed", "final_norm", "lm_head", "o_proj"):
        assert seen[key] == stage(p.outer + p.attention, key).shape
    assert seen["q"] == (int(np.prod(stage(p.attention, "q").shape)),)
    assert seen["k"] == (int(np.prod(stage(p.attention, "kv").shape[1:])),)
    if p.mlp:
        assert seen["gate"] == seen["act"] == stage(p.mlp, "act").shape
        assert seen["down_proj"] == stage(p.mlp, "down_proj").shape


# ---- runtime code ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3", "qwen2_moe"])
def test_code_refs_name_real_files_classes_and_kernels(engines, name):
    _, llm = engines(name)
    a = model_anatomy(llm)
    m = llm.runner.model
    layer = m.model.layers[0]
    assert a.code_for("input_norm").symbol == type(layer.input_layernorm).__name__
    assert a.code_for("o_proj").symbol == type(layer.self_attn.o_proj).__name__
    assert a.code_for("lm_head").symbol == type(m.lm_head).__name__
    assert (a.code_for("qk_norm") is not None) == a.arch.qk_norm
    for c in a.code:
        assert (ROOT / c.path).is_file(), c.path
        for k in c.kernels:
            assert k.path.startswith("engine/kernels/")
            mod = importlib.import_module(k.path[:-3].replace("/", "."))
            assert callable(getattr(mod, k.function))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_kernels_claimed_for_the_cpu_are_the_ones_that_run(engines, name, monkeypatch):
    """Count every claimed kernel's calls during a prefill + decode: each CPU one ran, no
    Triton one did."""
    _, llm = engines(name)
    a = model_anatomy(llm)
    calls: dict[tuple[str, str], int] = {}
    claimed = {(k.path, k.function): k for c in a.code for k in c.kernels}
    for (path, fn), _ in claimed.items():
        mod = importlib.import_module(path[:-3].replace("/", "."))
        real = getattr(mod, fn)

        def counted(*args, _real=real, _key=(path, fn), **kw):
            calls[_key] = calls.get(_key, 0) + 1
            return _real(*args, **kw)
        monkeypatch.setattr(mod, fn, counted)
    # one request with a penalty, so the sampler's optional path runs as well
    llm.generate(PROMPTS, [GREEDY, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                  presence_penalty=0.5)])
    for key, k in claimed.items():
        if k.runs_on("cpu"):
            assert calls.get(key, 0) > 0, f"{key} is claimed for the CPU but never ran"
        else:
            assert calls.get(key, 0) == 0, f"{key} is a GPU kernel but ran on the CPU"
    assert a.code_for("attention").kernels_on("cpu")      # the claim is not empty


def test_collectives_are_read_from_the_modules(engines):
    _, llm = engines("qwen2_moe")
    a = model_anatomy(llm)
    where = {c.where: c for c in a.collectives}
    assert where["layers.{L}.self_attn.o_proj"].layers == (0, 1, 2)
    assert where["layers.{L}.mlp.down_proj"].layers == (1,)     # the dense layer
    assert where["layers.{L}.mlp"].layers == (0, 2)              # MoE blocks reduce once
    assert where["embed_tokens"].op == "all_reduce" and where["lm_head"].op == "all_gather"
    assert not any("shared_expert" in w for w in where)          # summed inside the block


# ---- KV cache data plane ---------------------------------------------------------------------

def check_regions_hold_read_kv_block(llm, a):
    snap = llm.inspect()
    used = [b for b in snap.blocks if b.num_filled > 0]
    assert used, "the test needs blocks with data"
    kv = llm.runner.kv_cache
    for b in used[:3]:
        regions = a.kv.regions(b.block_id)
        assert len(regions) == 2 * a.arch.num_layers
        spans = sorted((r.offset, r.offset + r.nbytes) for r in regions)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:]))   # disjoint
        for r in regions:
            which = 0 if r.which == "k" else 1
            # the offset is where the tensor itself puts [which, layer, block]
            view = kv[which, r.layer, b.block_id]
            assert r.offset == (view.data_ptr() - kv.data_ptr())
            assert r.nbytes == view.numel() * view.element_size()
            raw = read_kv_cache_bytes(llm, r.offset, r.nbytes)
            got = np.frombuffer(raw, dtype=np.float32).reshape(r.shape)   # [slot, head, dim]
            assert np.abs(got).sum() > 0
            for head in range(r.shape[1]):
                np.testing.assert_array_equal(
                    got[:, head], llm.read_kv_block(b.block_id, r.layer, head, r.which))


def test_kv_regions_follow_the_strides_and_hold_what_read_kv_block_reads(engines):
    _, llm = engines("qwen3")
    llm.generate(PROMPTS, GREEDY)
    a = model_anatomy(llm)
    assert a.kv.shape == tuple(llm.runner.kv_cache.shape)
    assert a.kv.strides == tuple(llm.runner.kv_cache.stride())
    assert a.kv.block_bytes == llm.inspect().kv_layout.bytes_per_block
    check_regions_hold_read_kv_block(llm, a)


def test_kv_regions_and_reads_reject_what_is_outside_the_cache(engines):
    _, llm = engines("qwen3")
    a = model_anatomy(llm)
    with pytest.raises(ValueError, match="block_id must be in"):
        a.kv.regions(a.kv.num_blocks)
    with pytest.raises(ValueError, match="outside the KV cache"):
        read_kv_cache_bytes(llm, a.kv.total_bytes - 4, 8)


# ---- tensor parallelism ----------------------------------------------------------------------

def build_rank(cfg, rank: int, tp: int):
    """The engine's model as one rank builds it at degree tp, on the meta device (no memory,
    no process group: layers only read rank and size while they are built)."""
    with torch.device("meta"), use_tp(TPGroup(rank, tp)):
        return model_class(cfg)(cfg, 32)


def check_rank_matches_plan(model, plan, rank: int) -> None:
    share = plan.ranks[rank]
    lay = share.layout
    assert sum(p.numel() for p in model.parameters()) == share.params
    attn = model.model.layers[0].self_attn
    assert attn.num_heads == len(lay.q_heads) == plan.q_heads_per_rank
    assert attn.num_kv_heads == len(lay.kv_heads) == plan.kv_heads_per_rank
    assert attn.qkv_proj.kv_head_start == lay.kv_heads[0]
    emb = model.model.embed_tokens
    assert (emb.start, emb.end) == tuple(lay.vocab_slice)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            assert layer.mlp.experts.inter == lay.expert_slice[1] - lay.expert_slice[0]
        else:
            assert layer.mlp.gate_up_proj.weight.shape[0] == 2 * (lay.mlp_slice[1]
                                                                   - lay.mlp_slice[0])


WHAT_IF = {
    "qwen3 8 heads / 2 KV": ("qwen3", dict(num_attention_heads=8, num_key_value_heads=2,
                                           vocab_size=509)),
    "qwen3_moe": ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2_moe": ("qwen2_moe", dict(num_attention_heads=8, num_key_value_heads=2)),
}


@pytest.mark.parametrize("name", list(WHAT_IF))
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_what_if_tp_matches_layers_built_at_that_degree(name, tp):
    from tiny_models import make_config
    arch, kw = WHAT_IF[name]
    cfg = make_config(arch, **kw)
    a = architecture_of_config(cfg, name)
    plan = tp_plan(a, weight_breakdown(a, 4, "float32"), tp)
    assert plan.possible, plan.reason
    assert plan.kv_replicas == max(tp // 2, 1)          # 2 KV heads: replicated past TP 2
    for rank in (0, tp - 1):
        check_rank_matches_plan(build_rank(cfg, rank, tp), plan, rank)


def test_what_if_on_published_qwen3_30b_a3b_at_tp8_replicates_kv_heads():
    cfg = SimpleNamespace(**PUBLISHED["Qwen3-30B-A3B"][0], rms_norm_eps=1e-6)
    a = architecture_of_config(cfg, "Qwen3-30B-A3B")
    plan = tp_plan(a, weight_breakdown(a, 2, "bfloat16"), 8)
    assert (plan.q_heads_per_rank, plan.kv_heads_per_rank, plan.kv_replicas) == (4, 1, 2)
    assert [r.layout.kv_heads for r in plan.ranks] == [[r // 2] for r in range(8)]
    check_rank_matches_plan(build_rank(cfg, 5, 8), plan, 5)
    assert plan.fits


def test_what_if_refuses_a_degree_the_layers_cannot_split():
    from tiny_models import make_config
    a = architecture_of_config(make_config("qwen3"), "tiny")    # 4 heads
    plan = tp_plan(a, weight_breakdown(a, 4, "float32"), 8)
    assert not plan.possible and "num_attention_heads=4" in plan.reason and not plan.ranks
    big = architecture_of_config(PUBLISHED["Qwen2.5-72B"][0], "72B")
    one = tp_plan(big, weight_breakdown(big, 2, "bfloat16"), 1)
    assert one.possible and not one.fits                      # ~145 GB > 141 GB × 0.9
    assert tp_plan(big, weight_breakdown(big, 2, "bfloat16"), 2).fits


@pytest.fixture(scope="module", params=[("qwen3", dict(num_key_value_heads=1, vocab_size=511)),
                                        ("qwen2_moe", {})], ids=["qwen3-kv1", "qwen2_moe"])
def tp2(request, model_factory):
    arch, kw = request.param
    path = model_factory(arch, **kw)
    llm = LLM(path, tensor_parallel_size=2, num_kv_blocks=48, block_size=4)
    procs = list(getattr(llm.runner, "procs", []))
    yield path, llm
    llm.shutdown()
    assert not any(p.is_alive() for p in procs), "a TP worker outlived shutdown"


def test_tp2_rank0_holds_what_the_plan_says(tp2):
    path, llm = tp2
    a = model_anatomy(llm)
    plan = a.tp_plan()
    assert plan.tp == 2 and plan.possible
    assert [r.layout for r in plan.ranks] == llm.inspect().tp_layout
    assert a.rank0_params == plan.ranks[0].params
    assert a.weights.total_params == load_hf(path).num_parameters()
    assert a.kv.shape[4] == plan.kv_heads_per_rank
    check_rank_matches_plan(llm.runner.model, plan, 0)


def test_tp2_collectives_per_forward_equal_the_engines_count(tp2):
    _, llm = tp2
    llm.generate(PROMPTS, GREEDY)
    a = model_anatomy(llm)
    steps = llm.inspect().steps
    assert {s.collectives for s in steps} == {a.tp_plan().collectives_per_forward}
    assert a.tp_plan().collectives_per_forward == 2 * a.arch.num_layers + 2


def test_tp2_regions_hold_what_read_kv_block_reads(tp2):
    _, llm = tp2
    llm.generate(PROMPTS, GREEDY)
    check_regions_hold_read_kv_block(llm, model_anatomy(llm))


# ---- published shapes and the vocabulary -----------------------------------------------------

def test_published_totals_match_the_model_cards():
    for row in published_rows():
        for got, card in ((row.total_params, row.card_total), (row.active_params,
                                                                 row.card_active)):
            if card is None:
                continue
            digits = card[:-1]
            unit = 10 ** -len(digits.split(".")[1]) if "." in digits else 1
            assert abs(got / 1e9 - float(digits)) < unit, (row.name, got, card)
    by = {r.name: r for r in published_rows()}
    assert by["Qwen3-235B-A22B"].min_tp_h200 == 4 and by["Qwen2.5-72B"].min_tp_h200 == 2


def test_tokens_round_trip_and_the_chat_template_wraps_the_sample(engines):
    _, llm = engines("qwen3")
    tok = llm.tokenizer
    text = "hello world this is glassbox"
    pieces = tokenize(tok, text)
    assert [p.id for p in pieces] == tok.encode(text, add_special_tokens=False)
    assert "".join(p.text for p in pieces) == text
    v = model_anatomy(llm).vocabulary
    assert v.vocab_size == llm.hf_config.vocab_size and v.tokenizer_size == len(tok)
    assert {p.text for p in v.special} >= {"<|im_start|>", "<|im_end|>"}
    assert v.eos_ids == sorted(llm.eos_token_ids)
    assert v.chat_text.startswith("<|im_start|>system") and v.chat_text.endswith("assistant\n")
    specials = [p.id for p in v.chat_pieces if p.special]
    assert specials.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_parse_ids_says_what_is_wrong():
    assert parse_ids("1, 2 3", 10) == [1, 2, 3]
    with pytest.raises(ValueError, match="'x' is not a token id"):
        parse_ids("1 x", 10)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\)"):
        parse_ids("10", 10)

