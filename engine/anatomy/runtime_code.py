"""Which file of engine/ and which kernel of engine/kernels/ runs each stage of the forward,
read from the loaded model's modules and the bytecode of their forward methods (lazy imports
included), so the answer follows the code. Kernel files pair a Triton launcher with its torch
reference (`*_ref`, `*_cpu`); a launcher that picks between them itself ("dispatch") runs
everywhere.
"""
from __future__ import annotations

import dis
import functools
import importlib
import importlib.util
import inspect
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "engine.kernels."
TORCH_REFS = ("_ref", "_cpu")


@dataclass(frozen=True)
class KernelRef:
    path: str           # "engine/kernels/rmsnorm.py"
    function: str       # "fused_add_rms_norm"
    kind: str           # "triton" (GPU), "torch" (reference / CPU path) or "dispatch" (either)

    def runs_on(self, device: str) -> bool:
        if self.kind == "dispatch":
            return True
        return (self.kind == "triton") == str(device).startswith("cuda")


@dataclass(frozen=True)
class CodeRef:
    key: str                        # stage key, shared with the token path
    stage: str                      # what happens, in words
    path: str                       # "engine/layers/norm.py"
    symbol: str                     # "RMSNorm"
    helpers: tuple[str, ...]        # engine functions on the way ("engine/layers/gemm.py:linear")
    kernels: tuple[KernelRef, ...]
    torch_ops: tuple[str, ...]      # torch.nn.functional calls ("F.linear")
    collective: str | None = None   # "all_reduce" / "all_gather" issued at its end (TP > 1)

    def kernels_on(self, device: str) -> tuple[KernelRef, ...]:
        return tuple(k for k in self.kernels if k.runs_on(device))


def _relpath(obj) -> str:
    try:
        return Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT).as_posix()
    except (TypeError, ValueError):
        return getattr(obj, "__module__", "?")


def _codes(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _codes(c)


def _imported_modules(code: types.CodeType, package: str) -> list[types.ModuleType]:
    """Modules a function imports inside its body (`from ..kernels.x import f`)."""
    out, ins = [], list(dis.get_instructions(code))
    for i, instr in enumerate(ins):
        if instr.opname == "IMPORT_NAME":
            level = ins[i - 2].argval if i >= 2 and ins[i - 2].opname == "LOAD_CONST" else 0
            name = ("." * level + instr.argval) if level else instr.argval
            try:
                out.append(importlib.import_module(importlib.util.resolve_name(name, package)))
            except (ImportError, ValueError):
                pass
    return out


@functools.lru_cache(maxsize=None)
def references(fn) -> tuple:
    """Objects a function's code names: its globals, attributes of module globals it reads
    (`k.rms_norm`), and what it imports inside its body."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ()
    g = getattr(fn, "__globals__", {})
    package = (fn.__module__ or "").rpartition(".")[0]
    out = []
    for c in _codes(code):
        names = c.co_names
        modules = [g[n] for n in names if isinstance(g.get(n), types.ModuleType)]
        modules += _imported_modules(c, package)
        out += [g[n] for n in names if n in g and not isinstance(g[n], types.ModuleType)]
        for m in modules:
            out.append(m)
            out += [getattr(m, n) for n in names if hasattr(m, n)]
    return tuple(out)


_LAUNCHABLE = ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics")


def _is_jit(obj) -> bool:
    """A Triton kernel (compiled, interpreted, autotuned); not a constexpr helper like cdiv."""
    t = type(obj)
    return t.__module__.startswith("triton.runtime") and t.__name__ in _LAUNCHABLE


def _in_kernels(obj) -> bool:
    return isinstance(obj, types.FunctionType) and (obj.__module__ or "").startswith(KERNELS)


@functools.lru_cache(maxsize=None)
def _reaches_triton(fn, depth: int = 3) -> bool:
    for obj in references(fn):
        if _is_jit(obj):
            return True
        if depth and _in_kernels(obj) and obj is not fn and _reaches_triton(obj, depth - 1):
            return True
    return False


def kernel_kind(fn) -> str:
    if not _reaches_triton(fn):
        return "torch"
    own_refs = [o for o in references(fn) if _in_kernels(o) and o.__module__ == fn.__module__]
    if any(o.__name__.endswith(TORCH_REFS) for o in own_refs):
        return "dispatch"
    return "triton"


def is_compute(ref: KernelRef) -> bool:
    """A kernel computes: it launches Triton, or it is a torch reference / CPU path by name.
    Host-side helpers of the kernel modules (moe_configs.pick_config, a launch-config picker)
    compute nothing on tensors and are not claimed as kernels."""
    return ref.kind != "torch" or ref.function.endswith(TORCH_REFS)


def code_reached(fn, depth: int = 2) -> tuple[list, list[KernelRef], list[str]]:
    """(engine helper functions, kernels, torch.nn.functional ops) a function reaches."""
    helpers, kernels, ops = [], [], []
    for obj in references(fn):
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        mod = getattr(obj, "__module__", "") or ""
        if _in_kernels(obj) and not obj.__name__.startswith("_"):
            ref = KernelRef(_relpath(obj), obj.__name__, kernel_kind(obj))
            if is_compute(ref) and ref not in kernels:
                kernels.append(ref)
        elif (isinstance(obj, types.FunctionType) and mod.startswith("engine.") and depth
              and obj is not fn):
            h, k, o = code_reached(obj, depth - 1)
            if (k or o) and obj not in helpers and not obj.__name__.startswith("_"):
                helpers.append(obj)     # only helpers on the way to a kernel or a torch op
            helpers += [x for x in h if x not in helpers]
            kernels += [x for x in k if x not in kernels]
            ops += [x for x in o if x not in ops]
    fn = inspect.unwrap(fn)
    g = getattr(fn, "__globals__", {})
    for c in (_codes(fn.__code__) if hasattr(fn, "__code__") else ()):
        for n in c.co_names:
            m = g.get(n)
            if isinstance(m, types.ModuleType) and m.__name__ == "torch.nn.functional":
                ops += [f"F.{a}" for a in c.co_names if callable(getattr(m, a, None))
                        and f"F.{a}" not in ops]
    return helpers, kernels, ops


def collective_of(cls) -> str | None:
    """The collective a module's forward ends with, read from its code (TP > 1 only)."""
    names = getattr(getattr(cls, "forward", None), "__code__", None)
    names = names.co_names if names else ()
    if "all_reduce" in names:
        return "all_reduce"
    if "all_gather_dim" in names:
        return "all_gather"
    return None


def code_ref(key: str, stage: str, obj) -> CodeRef:
    """A stage run by a module instance (its class's forward) or by a plain function."""
    plain = isinstance(obj, types.FunctionType)
    fn = obj if plain else type(obj).forward
    owner = obj if plain else type(obj)
    helpers, kernels, ops = code_reached(fn)
    return CodeRef(key, stage, _relpath(owner), owner.__name__,
                   tuple(f"{_relpath(h)}:{h.__name__}" for h in helpers), tuple(kernels),
                   tuple(ops), None if plain else collective_of(type(obj)))


def _layer_stages(layer) -> list[tuple[str, str, object]]:
    attn, mlp = layer.self_attn, layer.mlp
    out = [("input_norm", "RMSNorm of the residual (fused with the residual add; at batch 1 on the "
            "GPU, inside the QKV GEMM)",
            layer.input_layernorm),
           ("qkv_proj", "q, k, v projections in one matmul", attn.qkv_proj)]
    if getattr(attn, "qk_norm", False):
        out.append(("qk_norm", "RMSNorm over each q and k head", attn.q_norm))
    out += [("rotary", "rotary position embedding on q and k", attn.rotary_emb),
            ("attention", "store k, v in the paged cache; attend over it", attn.attn),
            ("o_proj", "heads concatenated, projected back to hidden", attn.o_proj),
            ("post_norm", "RMSNorm of the residual (fused add; at batch 1 on the GPU, inside "
             "gate_up's GEMM when the MLP is dense; at decode batches on the GPU, inside the "
             "router's launch when it is MoE without a shared expert)",
             layer.post_attention_layernorm)]
    if hasattr(mlp, "experts"):
        out += [("router", "router logits over the experts", mlp.gate),
                ("experts", "top-k routing and the fused expert MLPs", mlp.experts)]
        if getattr(mlp, "shared_expert", None) is not None:
            out += [("shared_expert", "the always-on shared expert", mlp.shared_expert),
                    ("shared_gate", "sigmoid gate of the shared expert", mlp.shared_expert_gate)]
        out.append(("moe_block", "weighted sum of the experts (+ shared expert)", mlp))
    else:
        out += [("gate_up_proj", "gate and up projections in one matmul", mlp.gate_up_proj),
                ("act", "SiLU(gate) × up (at batch 1 on the GPU, in gate_up's GEMM as it "
                 "stores)", mlp),
                ("down_proj", "projection back to hidden", mlp.down_proj)]
    return out


def runtime_code(model) -> list[CodeRef]:
    """The forward of one token, stage by stage, from the loaded model (rank 0 with TP): the
    first dense layer and the first MoE layer stand for all layers of their kind."""
    from ..sampling import sample
    firsts: dict[bool, object] = {}        # dense or MoE -> its first layer
    for layer in model.model.layers:
        firsts.setdefault(hasattr(layer.mlp, "experts"), layer)
    stages = {"embed": ("embed", "embedding row lookup", model.model.embed_tokens)}
    for layer in firsts.values():
        for stage in _layer_stages(layer):
            stages.setdefault(stage[0], stage)
    stages = [*stages.values(),
              ("final_norm", "final RMSNorm (fused residual add)", model.model.norm),
              ("lm_head", "logits over the vocabulary", model.lm_head),
              ("sample", "sampler: greedy / temperature / top-k / top-p / min-p", sample)]
    return [code_ref(k, what, obj) for k, what, obj in stages]
