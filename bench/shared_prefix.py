"""Shared prefixes read once: 256 requests sharing a 2,048-token prefix (each +64 tokens of its
own, 128 out) against the same lengths with nothing shared, and the shared run again with
cascade attention off (KernelConfig.cascade_min_saved_tokens=0), all in one run. The prefix is
cached first (one request), as a served system prompt is. HF generate_batch on the first
requests of the shared workload is the peer."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (Request, base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, hf_generate_batch, hf_peer, log, median, random_prompt,
                          ratio_row, row, sampling, shutdown_engine, timed, vocab_size)

FULL = dict(num_requests=256, prefix=2048, own=64, out=128)
TINY = dict(num_requests=6, prefix=64, own=8, out=8)


def workloads(shape: dict, id_high: int, stream: int) -> tuple[list[int], list[Request],
                                                              list[Request]]:
    """(prefix, shared requests, unshared requests of the same lengths)."""
    n, p, own = shape["num_requests"], shape["prefix"], shape["own"]
    prefix = random_prompt(p, id_high, stream)
    shared = [Request(prefix + random_prompt(own, id_high, stream + 1 + i), shape["out"])
              for i in range(n)]
    unshared = [Request(random_prompt(p + own, id_high, stream + 5000 + i), shape["out"])
                for i in range(n)]
    return prefix, shared, unshared


def run(llm, requests: list[Request], device) -> tuple[float, list]:
    params = [sampling(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens)
              for r in requests]
    outs, secs = timed(lambda: llm.generate([r.prompt for r in requests], params), device)
    return sum(len(o.token_ids) for o in outs) / secs, outs


def measure(llm, shape, id_high, device, repeats: int, cascade_expected: bool) -> dict:
    out = {"shared": [], "unshared": [], "cascade_steps": 0, "saved_gib": 0.0}
    for r in range(repeats):
        prefix, shared, unshared = workloads(shape, id_high, 100 * (r + 1))
        llm.generate([prefix], sampling(temperature=0, max_tokens=1))      # the cached prefix
        before = len(llm.inspect().steps)
        tok_s, _ = run(llm, shared, device)
        steps = list(llm.inspect().steps)[before:]
        out["shared"].append(tok_s)
        out["cascade_steps"] += sum(bool(s.cascade_rows) for s in steps)
        out["saved_gib"] += sum(s.kv_bytes_saved for s in steps) / 2 ** 30
        out["unshared"].append(run(llm, unshared, device)[0])
        log(f"repeat {r}: shared {out['shared'][-1]:,.0f} tok/s, unshared "
            f"{out['unshared'][-1]:,.0f} tok/s")
    if cascade_expected and not out["cascade_steps"]:
        log("warning: no step of the shared workload used cascade attention")
    return out


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None, hf: bool = True,
         tiny: bool = False, repeats: int = 2, hf_num_requests: int = 16) -> list[dict]:
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = TINY if tiny else FULL
    id_high = min(10000, vocab_size(model))
    rows, ours = [], None
    length = shape["prefix"] + shape["own"] + shape["out"] + 16
    # tiny: too few tokens to pass the default threshold; 1 runs the path on any sharing
    for label, min_saved in (("cascade", 1 if tiny else None), ("no_cascade", 0)):
        llm = None
        try:
            kernels = {} if min_saved is None else {"cascade_min_saved_tokens": min_saved}
            llm = build_engine(model, dev, dtype, max_model_len=length, kernels=kernels)
            warm = dict(shape, num_requests=min(16, shape["num_requests"]), out=4)
            measure(llm, warm, id_high, dev, 1, False)                       # compile, capture
            m = measure(llm, shape, id_high, dev, repeats, min_saved != 0)
            note = f"{shape['num_requests']} req, median of {repeats}"
            shared = row("shared_prefix", model, "glassbox", f"shared_tok_s_{label}",
                         median(m["shared"]), "tok/s",
                         f"{note}; {m['cascade_steps']} cascade steps, "
                         f"{m['saved_gib']:.1f} GiB of KV not re-read")
            unshared = row("shared_prefix", model, "glassbox", f"unshared_tok_s_{label}",
                           median(m["unshared"]), "tok/s", note)
            rows += [shared, unshared, row("shared_prefix", model, "glassbox",
                                           f"shared_over_unshared_{label}",
                                           shared["value"] / unshared["value"], "x",
                                           "goal >= 3x with the cascade")]
            ours = ours or shared
        except Exception as exc:
            rows.append(error_row("shared_prefix", model, f"glassbox-{label}", exc))
        finally:
            shutdown_engine(llm)
            free_memory(dev)
    if hf:
        def peer_figures(hf_model) -> None:
            _, shared, _ = workloads(dict(shape, num_requests=hf_num_requests), id_high, 100)
            tokens, secs = hf_generate_batch(hf_model, shared, dev, temperature=0.6)
            peer = row("shared_prefix", model, "hf-generate_batch", "shared_tok_s_cascade",
                       tokens / secs, "tok/s", f"{hf_num_requests} req, 1 run")
            rows.append(peer)
            rows.extend(ratio_row("shared_prefix", model, "shared_tok_s_cascade", ours, peer))
        hf_peer(rows, "shared_prefix", model, dev, dtype, peer_figures, "hf-generate_batch")
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hf-num-requests", type=int, default=16)
    a = p.parse_args(argv)
    rows = main(a.model, a.device, a.dtype, not a.no_hf, a.tiny, 1 if a.tiny else a.repeats,
                min(a.hf_num_requests, 3) if a.tiny else a.hf_num_requests)
    finish_cli(rows, "shared_prefix", a.json)
    return rows


if __name__ == "__main__":
    cli()
