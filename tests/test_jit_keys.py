"""engine/kernels/jit_keys.py on the CPU: every name an eager kernel leaves unspecialized is one of
its arguments (a misspelt name would silently keep Triton's default key, and the recompiles).
Read from the source: under the interpreter the kernels keep no specialization lists."""

import ast
from pathlib import Path

import pytest

from engine.kernels import jit_keys

KERNEL_DIR = Path(jit_keys.__file__).parent
# the eager kernels that met per-step counts and offsets (tests/test_jit_keys_gpu.py)
EXPECTED = {"_prefill_kernel", "_partial_kernel", "_align_count_kernel", "_align_scan_kernel",
            "_align_place_kernel", "_align_single_kernel", "_w13_silu_mul_kernel",
            "_w2_weighted_kernel"}


def _varying_kernels() -> dict[str, tuple[list[str], list[str]]]:
    found = {}
    for path in KERNEL_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if not isinstance(dec, ast.Call):
                    continue
                for kw in dec.keywords:
                    if (kw.arg == "do_not_specialize" and isinstance(kw.value, ast.Call)
                            and getattr(kw.value.func, "id", "") == "varying"):
                        names = [a.value for a in kw.value.args]
                        found[node.name] = (names, [a.arg for a in node.args.args])
    return found


def test_every_eager_kernel_names_its_per_step_arguments():
    found = _varying_kernels()
    assert EXPECTED <= set(found), EXPECTED - set(found)
    for name, (names, params) in found.items():
        assert names and set(names) <= set(params), (name, set(names) - set(params))

