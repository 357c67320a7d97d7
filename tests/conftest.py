"""Shared fixtures: tiny random Qwen checkpoints built once per test session."""
from __future__ import annotations

import os
import sys

import pytest
import torch

# Interpret or compile is decided once per process, here: @triton.jit reads TRITON_INTERPRET when
# a kernel is defined (at its module's import), and engine/kernels/moe_align.py reads it again
# per call, so it must be set before anything (transformers included) imports triton and never
# change afterwards. pytest imports this file before any test module, so no test module sets it
# and the order in which they are imported cannot matter. CPU-only machines interpret; with CUDA
# the kernels compile (`TRITON_INTERPRET=1 pytest ...` runs the CPU kernel tests there).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_INTERPRETS = os.environ.get("TRITON_INTERPRET") == "1"

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import build_model_dir  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))

_BUILT: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _openai_models_built():
    """The OpenAI client's lazily built response models, built once here on one thread: its
    first use from several threads at once races (tests/client_models.py says how)."""
    from client_models import build_response_models
    build_response_models()


@pytest.fixture(scope="module")
def served():
    """The HTTP API in-process over the default tiny engine (tests/api_served.py), one per test
    module; a module that needs another engine defines its own `served`."""
    from api_served import ServedAPI
    s = ServedAPI()
    yield s
    s.close()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, **config_overrides) -> checkpoint dir (cached per arguments)."""
    def make(arch: str = "qwen3", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in _BUILT:
            d = tmp_path_factory.mktemp(f"{arch}")
            _BUILT[key] = build_model_dir(str(d), arch, **kw)
        return _BUILT[key]
    return make


@pytest.fixture
def triton_interpreter():
    """For tests that run Triton kernels on CPU tensors: skipped in a process whose kernels
    compile for the GPU (they cannot take CPU tensors, and the mode is fixed per process)."""
    if not TRITON_INTERPRETS:
        pytest.skip("Triton kernels compile in this process (CUDA is present); run these CPU "
                    "kernel tests in their own process with TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def qwen3_dir(model_factory):
    return model_factory("qwen3")


@pytest.fixture(scope="session")
def qwen2_dir(model_factory):
    return model_factory("qwen2")


# ---- a machine without the playground's packages (the GPU machine has no Gradio) ---------------
def pytest_ignore_collect(collection_path, config):
    """Without Gradio installed, modules that test the playground (or import its views, the API
    or the API's client libraries) are not collected, so `pytest -m gpu` runs on a GPU machine
    that has only the engine's packages.
    Where Gradio is installed (CI, laptops) every module is collected as usual."""
    import importlib.util
    if collection_path.suffix != ".py" or importlib.util.find_spec("gradio") is not None:
        return None
    import re
    text = collection_path.read_text(errors="ignore")
    if re.search(r"^\s*(import|from)\s+(gradio|views|app|api|api_served|ui_helpers|"
                 r"figure_helpers|pydantic|openai)\b", text, re.M):
        return True
    return None
