"""A/B of the engine's kernel choices (engine/kernel_config.py: KernelConfig's fields): one bench
script run under each setting in turn, alternating for several rounds, each run in a fresh
process, and the glassbox rows of every run in one table. Alternating keeps a slow first run or
a drifting host from landing on one variant (BENCH.md: before and after in one call).

    python bench/diagnostics/kernel_ab.py --variant pdl=0 --variant pdl=1 --rounds 2 \\
        -- bench/latency.py --no-hf --no-floors --repeats 3

A variant names KernelConfig fields: `--variant pdl=0,attn_context_caps=`. Every variant is
checked by KernelConfig before anything runs (an unknown name or a bad value stops here, not
after a round of runs measured with the defaults), then reaches the run's engine through
KernelConfig's environment names (GLASSBOX_PDL, ...), which KernelConfig.build reads when the
script builds its engine: any bench script works, with no flag of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.kernel_config import KernelConfig  # noqa: E402

DEFAULT_METRICS = ("decode_tok_s", "ms_per_token", "ttft_ms", "output_tok_s")  # name prefixes


def parse_variant(text: str) -> dict[str, str]:
    """'pdl=0,prefill_graphs=1' -> {name: value}, the names and values checked by KernelConfig
    (ValueError, its message naming the field and the valid names or values)."""
    choices = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not name.isidentifier():
            raise ValueError(f"a variant is NAME=VALUE[,NAME=VALUE...], got {text!r}")
        choices[name] = value
    if not choices:
        raise ValueError("an empty variant: give NAME=VALUE")
    KernelConfig.parse_overrides(choices)      # InvalidArgumentError is a ValueError
    return choices


def variant_environ(choices: dict[str, str]) -> dict[str, str]:
    """The environment that gives a run's engine these choices (KernelConfig's names for them)."""
    env = {f.name: f.metadata["env"] for f in fields(KernelConfig)}
    return {env[name]: value for name, value in choices.items()}


def run_once(script: list[str], env: dict[str, str], timeout: float) -> list[dict]:
    """The script's rows (its --json output) with `env` added to its environment, or one error
    row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, *script, "--json", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, timeout=timeout,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return [{"metric": "error", "system": "glassbox", "value": None,
                     "note": f"timed out after {timeout:.0f} s"}]
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return [{"metric": "error", "system": "glassbox", "value": None,
                     "note": f"exit {proc.returncode}: {tail[0][:200]}"}]
        return json.loads(out.read_text())


def main(variants: list[dict[str, str]], script: list[str], rounds: int = 2,
         metrics=DEFAULT_METRICS, timeout: float = 600.0) -> list[dict]:
    results = []
    for r in range(1, rounds + 1):
        for choices in variants:
            rows = run_once(script, variant_environ(choices), timeout)
            label = ",".join(f"{k}={v}" for k, v in choices.items())
            for row in rows:
                if row.get("system") != "glassbox":
                    continue
                if row["metric"] == "error":  # the table shows why
                    results.append({"variant": label, "round": r, "metric": "error",
                                    "value": row.get("note", ""), "note": row.get("note", "")})
                elif row["metric"].startswith(tuple(metrics)):
                    results.append({"variant": label, "round": r, "metric": row["metric"],
                                    "value": row["value"], "note": row.get("note", "")})
            print(f"[kernel_ab] round {r} {label}: "
                  + ", ".join(f"{x['metric']} {x['value']}" for x in results
                              if x["variant"] == label and x["round"] == r), flush=True)
    return results


def table(results: list[dict]) -> str:
    """Markdown: a row per variant, a column per metric and round."""
    metrics = list(dict.fromkeys(x["metric"] for x in results))
    rounds = sorted({x["round"] for x in results})
    cell = {(x["variant"], x["metric"], x["round"]): x["value"] for x in results}
    head = ["variant"] + [f"{m} (round {r})" for m in metrics for r in rounds]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v in dict.fromkeys(x["variant"] for x in results):
        vals = [cell.get((v, m, r)) for m in metrics for r in rounds]
        lines.append("| " + " | ".join([v] + ["—" if x is None else f"{x:,.4g}" if isinstance(x, float)
                                              else str(x) for x in vals]) + " |")
    return "\n".join(lines)


def cli(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: kernel_ab.py --variant pdl=1 --variant pdl=0 [--rounds N] -- SCRIPT [ARGS...]")
    split = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", required=True,
                   help=f"NAME=VALUE[,NAME=VALUE...], NAME one of {', '.join(KernelConfig.names())}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--metric", action="append", default=None,
                   help=f"metric name prefixes to keep (default: {', '.join(DEFAULT_METRICS)})")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv[:split])
    script = argv[split + 1:]
    if not script:
        p.error("give the bench script to run after --")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    results = main(variants, script, args.rounds, tuple(args.metric or DEFAULT_METRICS), args.timeout)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    cli()
