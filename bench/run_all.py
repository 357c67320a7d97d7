"""Run every benchmark in one budgeted pass (< 9 min on one H200), print one table, write
$OUT/bench.json and a markdown section for bench/RESULTS.md."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import common
from bench.common import (ROW_COLUMNS, format_table, free_memory, is_oom, log,
                          measure_floors, resolve_device, row, target_rows)


class SectionTimeout(BaseException):
    """Raised by the alarm when a section overruns; a BaseException so the scripts' `except
    Exception` figure-savers let it through while their `finally` blocks still free memory."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt the main thread after `seconds` (SIGALRM); restores any timer already set."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"ran past its {seconds:.0f}s budget")

    prev_left, _ = signal.getitimer(signal.ITIMER_REAL)
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if prev_left > 0:  # someone else's alarm (e.g. pytest-timeout) keeps running
            signal.setitimer(signal.ITIMER_REAL,
                             max(prev_left - (time.perf_counter() - t0), 1e-3))


class SharedEngine:
    """One Qwen3-0.6B engine for the latency, throughput and probes sections: building it (weights,
    KV cache, CUDA graphs) once saves two builds' worth of the budget."""

    def __init__(self, device: str, tiny: bool):
        self.device, self.tiny, self.llm = device, tiny, None

    def get(self):
        if self.llm is None:
            model = "tiny" if self.tiny else "qwen3-0.6b"
            self.llm = common.build_engine(model, resolve_device(self.device),
                                           max_model_len=256 if self.tiny else 4096)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            common.shutdown_engine(self.llm)
            self.llm = None
            free_memory()


@dataclass
class Section:
    name: str
    limit_s: float
    run: Callable[[], list[dict]]
    shared: bool = False  # uses the SharedEngine


def _kernel_section(module: str) -> Callable[[], list[dict]]:
    def run() -> list[dict]:
        import importlib
        mod = importlib.import_module(f"bench.{module}")
        out = mod.main(out_json=None) or []
        return [dict(r, section=module) for r in out]
    return run


def build_sections(a: argparse.Namespace, shared: SharedEngine) -> list[Section]:
    """In priority order: what matters most runs first, the 60 GB MoE last."""
    from bench import latency, long_context, moe, probes, shared_prefix, throughput, watched
    dev, hf, tiny = a.device, not a.skip_hf, a.tiny
    sections = [
        Section("latency", 75, lambda: latency.main(
            "qwen3-0.6b", dev, None, repeats=2 if tiny else 3, hf=hf,
            hf_repeats=1 if tiny else 2, tiny=tiny, floors=False, llm=shared.get()), True),
        Section("throughput", 150, lambda: throughput.main(
            "qwen3-0.6b", dev, None, num_requests=4 if tiny else a.num_requests, repeats=2,
            hf=hf, hf_num_requests=2 if tiny else a.hf_num_requests, tiny=tiny, floors=False,
            llm=shared.get()), True),
        Section("probes", 90, lambda: probes.main(
            "qwen3-0.6b", dev, None, num_requests=4 if tiny else 64,
            tput_repeats=1 if tiny else 3, lat_repeats=1 if tiny else 3, tiny=tiny,
            floors=False, llm=shared.get()), True),
        # the engine with the playground's pages polling beside it: the product's situation
        Section("watched", 120, lambda: watched.main(
            "qwen3-0.6b", dev, None, num_requests=4 if tiny else a.num_requests,
            tput_repeats=1 if tiny else 2, lat_repeats=1 if tiny else 3, tiny=tiny,
            floors=False, llm=shared.get()), True),
        # where the cost grows with the work: long prompts and contexts, a shared prefix
        Section("long_context", 100, lambda: long_context.main(
            "qwen3-0.6b", dev, None, hf=hf, tiny=tiny, repeats=1 if tiny else 3,
            report_floors=False)),
        Section("shared_prefix", 150, lambda: shared_prefix.main(
            "qwen3-0.6b", dev, None, hf=hf, tiny=tiny, repeats=1 if tiny else 2,
            hf_num_requests=2 if tiny else 16)),
    ]
    if not a.skip_kernels:
        sections += [Section("kernels", 60, _kernel_section("kernels")),
                     Section("moe_kernels", 60, _kernel_section("moe_kernels"))]
    if not a.skip_cpu:
        sections.append(Section("cpu", 100, lambda: latency.cpu_main(None, hf=hf, tiny=tiny,
                                                                     floors=False)))
    if not a.skip_moe:
        # 256 requests (the dense workload) take ~25 s more than the 128 of before
        sections.append(Section("moe", 240, lambda: moe.main(
            "qwen3-30b-a3b", dev, None, num_requests=4 if tiny else a.moe_num_requests,
            tput_repeats=1, lat_repeats=1 if tiny else 2, hf=hf, tiny=tiny, floors=False)))
    return sections


def run_sections(sections: list[Section], budget_s: float, shared: SharedEngine | None = None,
                 reserve_s: float = 10.0) -> tuple[list[dict], list[dict], list[dict]]:
    """Run each section under min(its limit, what is left of the budget). Returns
    (rows, kernel rows, section statuses); one section's failure never loses another's figures."""
    rows: list[dict] = []
    kernel_rows: list[dict] = []
    status: list[dict] = []
    t_start = time.perf_counter()
    for i, sec in enumerate(sections):
        left = budget_s - (time.perf_counter() - t_start) - reserve_s
        if left < min(sec.limit_s, 20):
            log(f"== {sec.name}: skipped, {max(left, 0):.0f}s of the budget left")
            status.append({"section": sec.name, "status": "skipped (budget)", "seconds": 0.0})
            continue
        cap = min(sec.limit_s, left)
        log(f"== {sec.name}: start (limit {cap:.0f}s)")
        mark = len(common.ROW_LOG)
        t0 = time.perf_counter()
        state = "ok"
        try:
            with time_limit(cap):
                out = sec.run()
        except SectionTimeout as exc:
            out = [dict(r) for r in common.ROW_LOG[mark:]]  # the figures it did finish
            out.append(row(sec.name, "-", "-", "error", None, "", f"timeout: {exc}"))
            state = "timeout"
        except Exception as exc:
            out = [dict(r) for r in common.ROW_LOG[mark:]]
            kind = "OOM" if is_oom(exc) else type(exc).__name__
            traceback.print_exc()
            out.append(row(sec.name, "-", "-", "error", None, "", f"{kind}: {str(exc)[:200]}"))
            state = f"failed ({kind})"
        finally:
            if shared is not None and (state == "timeout" or
                                       not any(s.shared for s in sections[i + 1:])):
                shared.close()  # after a timeout its state is unknown; else free it for the MoE
            free_memory()
        secs = time.perf_counter() - t0
        if sec.name in ("kernels", "moe_kernels") and state == "ok":
            kernel_rows += out
        else:
            rows += out
        if state == "ok" and any(isinstance(r, dict) and r.get("metric") == "error" for r in out):
            state = "ok (with errors)"
        log(f"== {sec.name}: {state} in {secs:.1f}s")
        status.append({"section": sec.name, "status": state, "seconds": round(secs, 1)})
    if shared is not None:
        shared.close()
    return rows, kernel_rows, status


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = "n/a"
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=5, cwd=common.REPO_ROOT).stdout.strip()
    except Exception:
        out["commit"] = ""
    return out


def markdown_section(report: dict) -> str:
    v = report["versions"]
    fl = ", ".join(f"{r['metric']} {r['value']:.3g} {r['unit']}" for r in report["floors"])
    lines = [
        f"## {report['date']} — {report['device']}",
        "",
        f"- Command: `{report['command']}`",
        f"- Device: {report['device']}; torch {v['torch']}, triton {v.get('triton')}, "
        f"transformers {v.get('transformers')}, commit {v.get('commit') or 'uncommitted'}",
        f"- Floors measured at the start: {fl or 'not measured'}",
        "- Peer in the same run: HF transformers (sdpa attention, random weights, same config): "
        "`model.generate` eager for latency and MoE (batch 32 for MoE throughput), "
        "continuous batching (`generate_batch`'s manager) for throughput, on the first "
        "requests of the same workload. Ratios are glassbox / peer (> 1: glassbox faster).",
        "- Sections: " + ", ".join(f"{s['section']} {s['status']} ({s['seconds']}s)"
                                    for s in report["sections"]),
        "",
        "### Targets (BENCH.md)",
        "",
        format_table([{"target": t["target"], "measured": t["measured"], "status": t["status"]}
                      for t in report["targets"]], markdown=True),
        "",
        "### Figures",
        "",
        format_table(report["rows"], ROW_COLUMNS, markdown=True),
    ]
    if report["kernel_rows"]:
        lines += ["", "### Kernels", "", format_table(report["kernel_rows"], markdown=True)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default=None)
    p.add_argument("--budget-s", type=float, default=530.0, help="wall budget for all sections")
    p.add_argument("--num-requests", type=int, default=256, help="0.6B throughput requests")
    p.add_argument("--hf-num-requests", type=int, default=32, help="HF throughput requests")
    p.add_argument("--moe-num-requests", type=int, default=256, help="30B-A3B throughput requests")
    p.add_argument("--skip-moe", action="store_true", help="skip the 30B-A3B section")
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--skip-hf", action="store_true", help="no HF peer (ratios are then missing)")
    p.add_argument("--only", default=None, help="comma list of section names to run")
    p.add_argument("--tiny", action="store_true", help="tiny models and counts (CPU smoke run)")
    p.add_argument("--results-md", default=None, help="append the markdown section to this file")
    a = p.parse_args(argv)
    t_all = time.perf_counter()
    dev = resolve_device(a.device)
    a.device = str(dev)
    args = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python bench/run_all.py"] + [shlex.quote(x) for x in args])
    log(f"run_all on {common.device_name(dev)}: {command}")
    floors: list[dict] = []
    try:
        floors = measure_floors(dev)
    except Exception as exc:
        floors = [common.error_row("floors", "-", "device", exc)]
    shared = SharedEngine(a.device, a.tiny)
    sections = build_sections(a, shared)
    if a.only:
        keep = set(a.only.split(","))
        sections = [s for s in sections if s.name in keep]
    rows, kernel_rows, status = run_sections(sections, a.budget_s - (time.perf_counter() - t_all),
                                             shared)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "device": common.device_name(dev),
        "command": command.strip(),
        "versions": versions(),
        "floors": [r for r in floors if r["value"] is not None],
        "rows": rows,
        "kernel_rows": kernel_rows,
        "targets": target_rows(rows),
        "sections": status,
        "total_s": round(time.perf_counter() - t_all, 1),
    }
    common.print_rows(floors + rows, "all figures")
    if kernel_rows:
        print("\n== kernels ==\n" + format_table(kernel_rows), flush=True)
    print("\n== targets ==\n" + format_table(report["targets"]), flush=True)
    md = markdown_section(report)
    print("\n== markdown for bench/RESULTS.md ==\n" + md, flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench.json").write_text(json.dumps(report, indent=2, default=str))
        (Path(out) / "bench.md").write_text(md)
        log(f"wrote {out}/bench.json and {out}/bench.md")
    if a.results_md:
        with open(a.results_md, "a") as f:
            f.write("\n" + md)
        log(f"appended to {a.results_md}")
    log(f"run_all done in {report['total_s']}s")
    return report


if __name__ == "__main__":
    main()
