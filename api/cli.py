"""The command line: Glassbox's own flags and vLLM's `serve` flags, with vLLM's meaning and
defaults where they apply, so a vLLM launch command starts Glassbox unchanged
(`vllm serve MODEL ...` -> `python app.py serve MODEL ...`).

Three kinds of vLLM flag:
- meant here: passed to the engine (`LLM(...)`) or the server with vLLM's meaning;
- tuning vLLM's own internals (`--disable-log-requests`, `--swap-space`): accepted, and one
  line at start says which changed nothing here;
- with no meaning here (a parser we do not ship, a chat template file, remote code): refused in
  one line naming the flag and what Glassbox does instead, before anything loads (exit 2).
An unknown flag is one line too, never argparse's usage dump. Imports nothing heavy: `--help`
and refusals answer at once.
"""
from __future__ import annotations

import argparse
import json
import sys

SERVE_PORT, PLAYGROUND_PORT = 8000, 7860     # `serve` listens where vLLM does

# vLLM's --dtype spellings (and the engine's short ones) -> the engine's dtype (None: per device)
DTYPES = {"auto": None, "half": "float16", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float": "float32", "float32": "float32",
          "fp32": "float32"}
TOOL_PARSERS = ("hermes",)                  # Qwen's <tool_call> JSON: what the API parses
REASONING_PARSERS = ("qwen3", "deepseek_r1")    # <think>...</think>: what the API splits off

# vLLM flags that tune vLLM itself: accepted; startup_notes() names the ones given
NOOP = {
    "disable_log_requests": ("--disable-log-requests", "no request log is kept"),
    "enable_log_requests": ("--enable-log-requests", "no request log is kept; the playground "
                                                     "shows every request"),
    "disable_log_stats": ("--disable-log-stats", "no stats log; /metrics has the counters"),
    "swap_space": ("--swap-space", "a preempted request is recomputed, never swapped"),
    "disable_frontend_multiprocessing": ("--disable-frontend-multiprocessing",
                                         "the API runs in the engine's process"),
    "distributed_executor_backend": ("--distributed-executor-backend",
                                     "-tp starts worker processes itself"),
    "disable_fastapi_docs": ("--disable-fastapi-docs", "the API serves no /docs"),
    "max_log_len": ("--max-log-len", "no request log is kept"),
}

# vLLM flags with no meaning here: refused with what Glassbox does instead
REFUSED = {
    "--trust-remote-code": "Glassbox never runs code from a checkpoint: it reads config, "
                           "tokenizer and weights as data and builds Qwen2/2.5/3 and their MoE "
                           "models itself (safe loading). Leave the flag out",
    "--chat-template": "Glassbox renders chats with the checkpoint's own chat template "
                       "(tokenizer_config.json or chat_template.jinja) and loads no template "
                       "from elsewhere. Put the template in the checkpoint, or leave the flag out",
    "--quantization": "Glassbox serves unquantized weights (bf16, fp16 or fp32: --dtype). "
                      "Leave the flag out",
    "-q": "Glassbox serves unquantized weights (bf16, fp16 or fp32: --dtype). Leave the flag "
          "out",
    "--tokenizer": "Glassbox uses the checkpoint's own tokenizer. Leave the flag out",
    "--pipeline-parallel-size": "Glassbox splits a model across GPUs by tensor parallelism "
                                "only. Use -tp N",
    "-pp": "Glassbox splits a model across GPUs by tensor parallelism only. Use -tp N",
    "--data-parallel-size": "one Glassbox serves one engine; start one per GPU group instead",
    "-dp": "one Glassbox serves one engine; start one per GPU group instead",
    "--enable-lora": "Glassbox serves no LoRA adapters; merge the adapter into the weights",
    "--lora-modules": "Glassbox serves no LoRA adapters; merge the adapter into the weights",
    "--kv-cache-dtype": "the KV cache is kept in the model's dtype. Leave the flag out",
    "--revision": "Glassbox loads a hub id's default revision; download the one you want and "
                  "pass its directory",
    "--load-format": "Glassbox loads safetensors. Leave the flag out",
}


class CLIError(Exception):
    """A flag refused: the one line parse() prints before exiting with status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):      # argparse's own complaints: one line, no usage dump
        raise CLIError(f"{message} (`python app.py serve --help` lists the flags)")


def _list(text: str) -> list[str]:
    """vLLM's JSON list ('["https://a.example"]'), or a comma-separated one."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError("a JSON list of strings, e.g. '[\"*\"]'")
        return [i.strip() for i in items]
    return [i.strip() for i in text.split(",") if i.strip()]


def build_parser(description: str = "Glassbox") -> argparse.ArgumentParser:
    p = _Parser(prog="app.py", description=description, allow_abbrev=False,
                usage="python app.py [serve] [MODEL] [flags]  (vLLM's `serve` flags work too)")
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="HF-format dir or hub id (default: assets/demo-qwen3)")
    p.add_argument("--model", help="the same as MODEL (today's spelling)")

    g = p.add_argument_group("engine (vLLM's meaning and defaults)")
    g.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    g.add_argument("--dtype", default="auto",
                   help="auto, half, float16, bfloat16, float, float32 (default auto: bf16 on "
                        "GPU, fp32 on CPU)")
    g.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tensor_parallel_size",
                   type=int, default=1, metavar="N", help="tensor-parallel size")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                   type=int, help="KV blocks (default: sized from memory)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens in one step (the chunked-prefill budget)")
    g.add_argument("--max-model-len", type=int, help="max prompt + reply tokens")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="always on here")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--seed", type=int, default=0, help="the engine's random seed")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or a draft model '
                   'with the same tokenizer, \'{"model": "PATH", "num_speculative_tokens": 4}\' '
                   '(a request may turn it off with num_speculative_tokens 0)')

    g = p.add_argument_group("the OpenAI-compatible server (vLLM's meaning)")
    g.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to expose)")
    g.add_argument("--port", type=int, help=f"default {SERVE_PORT} with `serve` (vLLM's), "
                                            f"else {PLAYGROUND_PORT}")
    g.add_argument("--api-key", help="require this key on every route: 'Authorization: Bearer "
                                     "KEY' for the API and scripts, a one-time login page for "
                                     "browsers (default: $GLASSBOX_API_KEY, else "
                                     "$VLLM_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the ids the model answers to; the first is what /v1/models lists "
                        "(default: the checkpoint's name, and the MODEL argument as given)")
    g.add_argument("--root-path", help="the path prefix a reverse proxy serves this under")
    g.add_argument("--allowed-origins", type=_list, metavar="LIST",
                   help="CORS origins, a JSON list or comma-separated (default: * with a key; "
                        "this machine's pages without one)")
    g.add_argument("--allowed-methods", type=_list, default=["*"], metavar="LIST",
                   help="CORS methods (default *)")
    g.add_argument("--allowed-headers", type=_list, default=["*"], metavar="LIST",
                   help="CORS headers (default *)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    g.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info",
                                                   "debug", "trace"], default="warning",
                   help="the HTTP server's log level (info logs each request)")
    g.add_argument("--tool-call-parser", default="hermes",
                   help="hermes: Qwen's <tool_call> format, always parsed")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="always on: tool_choice auto is served")
    g.add_argument("--reasoning-parser", help="qwen3 or deepseek_r1: reasoning_content is "
                                              "split off at <think> whenever the template uses it")
    g.add_argument("--generation-config", default="auto",
                   help="auto: sampling defaults from the checkpoint's generation_config.json")
    g.add_argument("--response-role", default="assistant", help="assistant (the only one)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="always on: X-Request-Id is echoed")

    g = p.add_argument_group("connections")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle connection is kept between requests (uvicorn's 5)")
    g.add_argument("--timeout-header", type=float, default=10.0,
                   help="seconds for a request's headers to arrive")
    g.add_argument("--timeout-body", type=float, default=30.0,
                   help="seconds for a request's body to arrive after its headers")
    g.add_argument("--max-connections", type=int,
                   help="open connections; beyond, a 503 (default 4,096, within the file "
                        "descriptor limit)")

    g = p.add_argument_group("the playground and a shared server")
    g.add_argument("--share", action="store_true", help="make a public gradio.live link")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve beyond localhost (--host 0.0.0.0, --share) without a key")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated extra Host names a keyless server answers "
                        "(*.example.com, or * for any); localhost and IP addresses always are; "
                        "with a key every name is")
    g.add_argument("--no-model-switch", action="store_true",
                   help="hide and refuse the playground's model switch (a shared server)")
    g.add_argument("--no-burst", action="store_true",
                   help="hide and refuse the KV tab's shared-prefix burst (a shared server)")
    g.add_argument("--public-traces", action="store_true",
                   help="every client may list and read every trace (default: an API client "
                        "its own; a page its own replies, and everyone's only when the server "
                        "has no key and listens on this machine alone)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body in bytes (default 4 MiB)")
    g.add_argument("--max-stop-strings", type=int, default=64, help="stop strings per request")
    g.add_argument("--max-stop-chars", type=int, default=256,
                   help="characters per stop string")
    g.add_argument("--max-stop-token-ids", type=int, default=1024,
                   help="stop_token_ids per request")
    g.add_argument("--max-choices", type=int, default=64,
                   help="prompts x n a request may ask for (each is a request in the engine)")
    g.add_argument("--max-logprob-entries", type=int, default=1 << 18,
                   help="logprob entries one reply may carry (tokens x (1 + alternatives))")
    g.add_argument("--isolate-prefix-cache", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="salt each user's prefix-cache chain, so nobody learns from a faster "
                        "first token what another user sent (default: on when the server has "
                        "a key or listens beyond this machine, off for one user)")
    g.add_argument("--max-sessions", type=int, default=256,
                   help="browser/API sessions Gradio keeps in memory (the oldest go first)")

    g = p.add_argument_group("vLLM flags accepted that change nothing here")
    g.add_argument("--disable-log-requests", action="store_true")
    g.add_argument("--enable-log-requests", action="store_true")
    g.add_argument("--disable-log-stats", action="store_true")
    g.add_argument("--swap-space", type=float)
    g.add_argument("--disable-frontend-multiprocessing", action="store_true")
    g.add_argument("--distributed-executor-backend")
    g.add_argument("--disable-fastapi-docs", action="store_true")
    g.add_argument("--max-log-len", type=int)
    return p


def parse(argv: list[str] | None = None, description: str = "Glassbox") -> argparse.Namespace:
    """Parse the command line; a refused or unknown flag prints one line and exits 2."""
    try:
        return _parse(list(sys.argv[1:] if argv is None else argv), description)
    except CLIError as e:
        print(f"app.py: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def _parse(argv: list[str], description: str) -> argparse.Namespace:
    serve = bool(argv) and argv[0] == "serve"
    args, extra = build_parser(description).parse_known_args(argv[1:] if serve else argv)
    for item in extra:
        if item.startswith("-"):
            flag = item.split("=", 1)[0]
            if flag in REFUSED:
                raise CLIError(f"{flag} is not supported: {REFUSED[flag]}.")
            raise CLIError(f"{flag} is not a flag Glassbox knows, nor a vLLM flag it takes "
                           "(`python app.py serve --help` lists them)")
    if extra:
        raise CLIError(f"unexpected argument {extra[0]!r}: give one MODEL (a directory or hub "
                       "id) before or after the flags")
    if args.model_arg and args.model and args.model_arg != args.model:
        raise CLIError(f"two models given ({args.model_arg!r} and --model {args.model!r}): "
                       "give one")
    args.model = args.model or args.model_arg
    del args.model_arg
    args.serve = serve
    if args.port is None:
        args.port = SERVE_PORT if serve else PLAYGROUND_PORT
    _check_values(args)
    return args


def _check_values(args) -> None:
    if args.dtype not in DTYPES:
        raise CLIError(f"--dtype {args.dtype} is not supported: use auto, half, float16, "
                       "bfloat16, float or float32 (vLLM's spellings; bf16, fp16, fp32 too)")
    if args.tool_call_parser not in TOOL_PARSERS:
        raise CLIError(f"--tool-call-parser {args.tool_call_parser} is not supported: "
                       "Glassbox parses tool calls in Qwen's <tool_call> JSON format (vLLM's "
                       "hermes parser), always, and ships no other. Pass --tool-call-parser "
                       "hermes or leave the flag out")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise CLIError(f"--reasoning-parser {args.reasoning_parser} is not supported: Glassbox "
                       "splits reasoning_content off at <think>...</think> (vLLM's qwen3 and "
                       "deepseek_r1 parsers) whenever the chat template uses <think>. Pass "
                       "qwen3 or deepseek_r1, or leave the flag out")
    if args.generation_config != "auto":
        raise CLIError(f"--generation-config {args.generation_config} is not supported: "
                       "Glassbox takes sampling defaults from the checkpoint's "
                       "generation_config.json (vLLM's auto); a request's own fields override "
                       "them. Leave the flag out")
    if args.response_role != "assistant":
        raise CLIError(f"--response-role {args.response_role} is not supported: Glassbox "
                       "replies with the role 'assistant'. Leave the flag out")
    for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be a positive integer, got "
                           f"{getattr(args, name)}")
    for name in ("timeout_keep_alive", "timeout_header", "timeout_body"):
        if not getattr(args, name) > 0:
            raise CLIError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if args.max_connections is not None and args.max_connections < 1:
        raise CLIError("--max-connections must be a positive integer")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise CLIError("--served-model-name: a name is empty; pass one or more non-empty names")


def engine_kwargs(args) -> dict:
    """The LLM(...) keyword arguments the flags ask for."""
    return dict(device=args.device, dtype=DTYPES[args.dtype],
                tensor_parallel_size=args.tensor_parallel_size, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                enforce_eager=args.enforce_eager, seed=args.seed,
                speculative_config=args.speculative_config)


def startup_notes(args) -> str | None:
    """One line naming the vLLM flags given that change nothing here, or None."""
    said = [f"{flag} ({why})" for name, (flag, why) in NOOP.items()
            if getattr(args, name, None) not in (None, False)]
    if not args.enable_chunked_prefill:
        said.append("--no-enable-chunked-prefill (prefill is always chunked, under "
                    "--max-num-batched-tokens)")
    if not said:
        return None
    return "vLLM flags that change nothing here: " + "; ".join(said)


def cors_settings(args):
    from .cors import CORSSettings
    return CORSSettings(
        allowed_origins=tuple(args.allowed_origins) if args.allowed_origins is not None
        else None, allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials)


def connection_limits(args):
    from .connections import ConnectionLimits
    return ConnectionLimits(timeout_header=args.timeout_header, timeout_body=args.timeout_body,
                            timeout_keep_alive=args.timeout_keep_alive,
                            max_connections=args.max_connections)
