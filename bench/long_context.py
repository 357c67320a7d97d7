"""Long contexts against the hardware's floor: TTFT of one 4k / 16k / 32k-token prompt (the
causal prefill's FLOPs at the measured matmul rate) and batch-1 decode at 8k / 30k tokens of
context (the weights plus that context's K/V at the measured copy bandwidth). HF transformers'
TTFT at the shortest prompt in the same run."""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (base_parser, bench_setup, build_engine, error_row, finish_cli,
                          free_memory, hf_config, hf_generate, hf_peer, log, measure_floors,
                          median, random_prompt, ratio_row, row, sampling, shutdown_engine, timed,
                          vocab_size)

FULL = dict(ttft=(4096, 16384, 32768), decode=(8192, 30720), new_tokens=64)
TINY = dict(ttft=(64, 128), decode=(96,), new_tokens=8)


def prefill_flops(cfg, n: int) -> float:
    """Matmul FLOPs of one n-token causal prefill: the weights' 2 x params x tokens (without the
    embedding lookup) and attention's QK^T and PV over the causal half of the n x n scores."""
    from engine.model_size import param_count
    params = param_count(cfg) - cfg.vocab_size * cfg.hidden_size     # embedding: a lookup
    if getattr(cfg, "tie_word_embeddings", False):
        params += cfg.vocab_size * cfg.hidden_size                   # ...but the LM head reads it
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * d * n * n / 2
    return 2 * params * n + attn


def decode_bytes(cfg, context: int, dtype_bytes: int = 2) -> float:
    """Bytes one batch-1 decode step must read: every weight once, the context's K and V."""
    from engine.model_size import param_count
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * dtype_bytes * context
    return param_count(cfg) * dtype_bytes + kv


def glassbox_ttft_ms(llm, n: int, id_high: int, device, repeats: int) -> float:
    times = []
    for r in range(repeats):     # fresh ids each time: the prefix cache never hits
        prompt = random_prompt(n, id_high, 7000 + 10 * r + n % 7)
        _, t = timed(lambda: llm.generate([prompt], sampling(temperature=0, max_tokens=1)),
                     device)
        times.append(1e3 * t)
    return median(times)


def glassbox_decode_ms(llm, context: int, id_high: int, new_tokens: int) -> float:
    prompt = random_prompt(context - new_tokens, id_high, 8000 + context % 11)
    stamps = [time.perf_counter() for ev in llm.stream(
        prompt, sampling(temperature=0, ignore_eos=True, max_tokens=new_tokens))
        if ev.token_id is not None]
    return 1e3 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main(model: str = "qwen3-0.6b", device: str | None = None, dtype=None, hf: bool = True,
         tiny: bool = False, repeats: int = 3, report_floors: bool = True) -> list[dict]:
    """The floors are measured either way (the notes need them); `report_floors`: their rows
    too (run_all has its own)."""
    model, dev, dtype = bench_setup(model, device, dtype, tiny)
    shape = TINY if tiny else FULL
    cfg = hf_config(model)
    floor_rows = measure_floors(dev)
    rows = list(floor_rows) if report_floors else []
    flops = next(r["value"] * 1e12 for r in floor_rows if r["metric"].startswith("matmul"))
    # a copy's rate counting the bytes read plus written: a read-only stream moves as many a second
    bandwidth = next(r["value"] * 1e12 for r in floor_rows if r["metric"] == "copy_bandwidth")
    id_high = min(10000, vocab_size(model))
    longest = max(shape["ttft"] + shape["decode"]) + 64
    llm, ours = None, None
    try:
        llm = build_engine(model, dev, dtype, max_model_len=longest, max_num_seqs=8)
        llm.generate([random_prompt(shape["ttft"][0], id_high, 6999)],      # compile
                     sampling(temperature=0, max_tokens=4))
        for n in shape["ttft"]:
            ms = glassbox_ttft_ms(llm, n, id_high, dev, repeats)
            floor = f", floor {1e3 * prefill_flops(cfg, n) / flops:.1f} ms"
            r = row("long_context", model, "glassbox", f"ttft_ms_{n}", ms, "ms",
                    f"median of {repeats}{floor}")
            rows.append(r)
            ours = ours or r
            log(f"TTFT {n} tokens: {ms:.1f} ms{floor}")
        for c in shape["decode"]:
            ms = glassbox_decode_ms(llm, c, id_high, shape["new_tokens"])
            floor = f", floor {1e3 * decode_bytes(cfg, c) / bandwidth:.2f} ms"
            rows.append(row("long_context", model, "glassbox", f"decode_ms_per_token_{c}", ms,
                            "ms", f"batch 1, {shape['new_tokens']} tokens{floor}"))
            log(f"decode at {c} context: {ms:.3f} ms/token{floor}")
    except Exception as exc:
        rows.append(error_row("long_context", model, "glassbox", exc))
    finally:
        shutdown_engine(llm)
        free_memory(dev)
    if hf:
        def peer_figures(hf_model) -> None:
            n = shape["ttft"][0]
            hf_generate(hf_model, [random_prompt(n, id_high, 6998)], 1, dev)     # warm
            _, t = timed(lambda: hf_generate(hf_model, [random_prompt(n, id_high, 6997)], 1, dev),
                         dev)
            peer = row("long_context", model, "hf-generate", f"ttft_ms_{n}", 1e3 * t, "ms",
                       "1 run")
            rows.append(peer)
            rows.extend(ratio_row("long_context", model, f"ttft_ms_{n}", ours, peer,
                                  higher_is_better=False))
        hf_peer(rows, "long_context", model, dev, dtype, peer_figures)
    return rows


def cli(argv=None) -> list[dict]:
    p = base_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    rows = main(a.model, a.device, a.dtype, not a.no_hf, a.tiny,
                min(a.repeats, 2) if a.tiny else a.repeats, not a.no_floors)
    finish_cli(rows, "long_context", a.json)
    return rows


if __name__ == "__main__":
    cli()
