"""The engine package's import graph has no cycle, and every engine module imports on its own.

The graph is read from the source with `ast` (every `import` in a module, function-level ones
included: a cycle through a lazy import is still a cycle, it only fails later). An edge goes to
the module named, not to its parent packages, as Python's own cycle errors do.
"""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "engine"


def engine_modules() -> dict[str, str]:
    """module name -> file, for every .py under engine/."""
    mods = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return mods


def imported(module: str, node: ast.AST, mods: dict[str, str]) -> list[str]:
    """The engine modules one import statement of `module` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if node.level:                              # relative: from the module's package upwards
        here = module.split(".")
        if not mods[module].endswith("__init__.py"):
            here = here[:-1]
        base = here[:len(here) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for a in node.names:                        # `from pkg import sub` loads pkg.sub
        sub = f"{target}.{a.name}"
        out.append(sub if sub in mods else target)
    return [m for m in out if m in mods]


def import_graph() -> dict[str, set[str]]:
    mods = engine_modules()
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[m].update(t for t in imported(m, node, mods) if t != m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None
    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_engine_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    """The check above can fail: a graph with a cycle through three modules is caught."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "engine.sampling_params" in graph["engine.sampling"]        # from .x import y
    assert "engine.kernels.sampling_kernel" in graph["engine.sampling"]  # inside a function
    assert "engine.errors" in graph["engine.probes.spec"]                # from ..x import y


def test_every_engine_module_imports():
    """In a fresh interpreter, so modules this test session already loaded hide nothing."""
    pytest.importorskip("triton")
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)"
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    r = subprocess.run([sys.executable, "-c", code, *sorted(engine_modules())], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_public_names_stay_importable():
    """The split of engine/sampling.py keeps every old import path working."""
    engine = importlib.import_module("engine")
    sampling = importlib.import_module("engine.sampling")
    params = importlib.import_module("engine.sampling_params")
    assert engine.SamplingParams is sampling.SamplingParams is params.SamplingParams
    assert sampling.uniform_noise is importlib.import_module("engine.sampling_noise").uniform_noise
