"""Glassbox playground: parse flags, load the engine once, build the Gradio UI, launch it.

`python app.py` serves the bundled demo checkpoint (assets/demo-qwen3); when that is missing it
builds a tiny random Qwen3 in a fresh private temp dir so the app still runs offline, and says
so in a banner.
"""
from __future__ import annotations

import argparse
import atexit
import os
import socket
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEMO_DENSE = ROOT / "assets" / "demo-qwen3"
DEMO_MOE = ROOT / "assets" / "demo-qwen3-moe"
CSS_PATH = ROOT / "assets" / "style.css"
FALLBACK_BANNER = ("**assets/demo-qwen3 is missing**: running a tiny *random* Qwen3 built at "
                   "start, so replies are gibberish. The engine and every view work the same; "
                   "pass `--model` for a real checkpoint.")

# a few sentences to train the fallback's byte-level BPE tokenizer on
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Glassbox is an inference engine with glass walls: you can watch it think.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill chunks with decode steps.",
    "Prefix caching lets requests that share a system prompt reuse the same blocks.",
    "Hello! How are you today? Tell me a story about a small robot.",
    "You are a helpful assistant. Answer briefly and clearly.",
]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_fallback_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 (4 layers, hidden 64) with a freshly trained tokenizer, in HF format."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    hf_tok.chat_template = _CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    eos = hf_tok.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(vocab_size=len(hf_tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                      rope_theta=10000.0, eos_token_id=eos,
                      bos_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():   # wider than HF's 0.02 init so the random model's choices vary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
        # EOS logit pinned at 0 (tied embedding row) while others spread ~±5: replies run to
        # max tokens instead of stopping at a random early EOS, which makes streaming visible
        model.get_input_embeddings().weight[eos].zero_()
    model.save_pretrained(out)
    return out


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """(path or hub id, banner or None): the flag, else the demo checkpoint, else the fallback."""
    if model:
        return model, None
    if (DEMO_DENSE / "config.json").exists():
        return str(DEMO_DENSE), None
    # a fresh private (0700) dir each start: never a predictable shared path that someone else
    # could have filled first, and loaded as trusted
    tmp = Path(tempfile.mkdtemp(prefix="glassbox-fallback-qwen3-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    build_fallback_checkpoint(tmp)
    return str(tmp), FALLBACK_BANNER


def demo_choices() -> dict[str, str]:
    """The bundled demos present on disk, for the model switch (shown when there are two)."""
    found = {"dense demo (demo-qwen3)": DEMO_DENSE, "MoE demo (demo-qwen3-moe)": DEMO_MOE}
    return {k: str(v) for k, v in found.items() if (v / "config.json").exists()}


def switch_choices(model: str | None, no_switch: bool = False) -> tuple[str | None, dict]:
    """(the model to load, the demos the model switch offers): both demos when no --model was
    given or when it names one of them (then given as the switch knows it, so the selector
    shows it chosen); none for any other checkpoint, or with --no-model-switch."""
    demos = {} if no_switch else demo_choices()
    if model is None:
        return model, demos
    named = Path(model).expanduser()
    for path in demos.values():
        if named.exists() and named.resolve() == Path(path).resolve():
            return path, demos
    return model, {}


SYNC_S = 2.0   # how often each page checks that the model it shows is still the one loaded


def build_app(llm, *, banner: str | None = None, choices: dict[str, str] | None = None,
              llm_kwargs: dict | None = None, allow_burst: bool = True,
              public_traces: bool = True, served_model_names: tuple[str, ...] = ()):
    """The playground as a gr.Blocks over a running LLM (tests launch it in-process).
    A shared server turns off the controls that change it for everyone: no `choices` hides
    (and refuses) the model switch, `allow_burst=False` the shared-prefix burst.
    `served_model_names`: vLLM's --served-model-name, the ids the API answers to (the first
    is listed); none: the checkpoint's name and the path it was started from (api.model_names)."""
    import gradio as gr

    from api.model_names import check_names
    from views import anatomy, chat, engine_view, interventions, kv_cache, layers, tour
    from views.live import EngineHub, LiveTab
    from views.live_plot import preload_plotly

    hub = EngineHub(llm, llm_kwargs=llm_kwargs or {}, choices=choices or {})
    hub.served_model_names = check_names(served_model_names)    # read by api/routes.py
    hub.burst_enabled = allow_burst     # read by views/kv_cache.py
    hub.switch = _refreezing(hub.switch)
    # may a page show other pages' and API clients' traces (views/layers.py): yes on one's own
    # machine; a shared server (a key, or reachable from elsewhere) only with --public-traces
    hub.public_traces = public_traces
    with gr.Blocks(title="Glassbox") as demo:
        with gr.Row(elem_id="header"):
            gr.Markdown("## Glassbox — an inference engine with glass walls",
                        elem_id="title")
            switch = gr.Dropdown(list(hub.choices), value=hub.current_choice(),
                                 label="model (shared by everyone on this server)",
                                 visible=len(hub.choices) > 1, elem_id="model-switch", scale=0,
                                 min_width=300)
            tour.restart_button()
        gr.Markdown(banner or "", visible=bool(banner), elem_id="banner")
        preload_plotly()
        model_line = gr.Markdown(hub.model_line(), elem_id="model-line")
        seen = gr.State(None)      # (generation, loading) of the model this page shows
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Chat", id="chat", elem_id="tab-chat") as tab_chat:
                chat_parts = chat.build(hub)
            with gr.Tab("KV cache", id="kv", elem_id="tab-kv") as tab_kv:
                kv_tab = kv_cache.build(hub)
            with gr.Tab("Layers", id="layers", elem_id="tab-layers") as tab_layers:
                layers_tab = layers.build(hub)
                rerun_head = interventions.rerun_button()     # "what if" without this head
                rerun_expert = interventions.rerun_expert_button()    # ... or this expert
            with gr.Tab("Engine", id="engine", elem_id="tab-engine") as tab_engine:
                engine_tab = engine_view.build(hub)
            with gr.Tab("Anatomy", id="anatomy", elem_id="tab-anatomy") as tab_anatomy:
                anatomy_timer = anatomy.build(hub)
        tour.build(hub.is_demo(), llm.block_size)     # the first run's guided walk, once
        # the Layers tab's layer and head pickers and its routing chart, by their elem_ids
        by_id = {getattr(c, "elem_id", None): c for c in layers_tab.inputs + layers_tab.outputs}
        interventions.wire_from_layers(rerun_head, by_id["layers-layer"], by_id["layers-head"],
                                       chat_parts.whatif, tabs)
        interventions.wire_expert_from_layers(by_id["layers-routing"], rerun_expert,
                                              chat_parts.whatif, tabs)
        # only the visible tab polls the engine: hidden tabs cost nothing; a tab refreshes
        # at once when opened instead of waiting for its first tick
        anatomy_tab = LiveTab(anatomy_timer, None, [], [])   # its tick notices a model swap
        live_tabs = [kv_tab, layers_tab, engine_tab, anatomy_tab]
        timers = [t.timer for t in live_tabs]
        for tab, live in ((tab_chat, None), (tab_kv, kv_tab), (tab_layers, layers_tab),
                          (tab_engine, engine_tab), (tab_anatomy, anatomy_tab)):
            ev = tab.select(lambda live=live: [gr.Timer(active=live is not None and t is live.timer)
                                              for t in timers],
                            outputs=timers, api_visibility="private", queue=False,
                            show_progress="hidden", show_progress_on=[seen])
            if live is not None and live.refresh is not None:
                ev.then(live.refresh, live.inputs, live.outputs, api_visibility="private",
                        show_progress="hidden", show_progress_on=live.inputs[:1] or [seen])

        whatif = chat_parts.whatif
        sync_outputs = [model_line, switch, chat_parts.max_tokens, chat_parts.examples,
                        whatif.kind, whatif.help, seen]

        def sync(seen_state):
            """The model line, selector and model limits as they are now on the server: a new
            visitor, and every open page after another visitor switched, sees the truth."""
            now = (hub.generation, hub.switching)
            if seen_state == now:
                return [gr.skip()] * len(sync_outputs)
            limit = chat.max_tokens_limit(hub.llm)
            return [hub.model_line(),
                    gr.Dropdown(value=hub.current_choice(), interactive=not hub.switching),
                    gr.Slider(maximum=limit, label=chat.max_tokens_label(hub.llm)),
                    gr.Row(visible=hub.is_demo()),
                    gr.Radio(choices=interventions.kinds_for(bool(hub.llm.moe_layers)),
                             value="ablate heads"),
                    interventions.form_help(hub.llm), now]

        def on_switch(choice, seen_state):
            if choice and choice != hub.current_choice() and not hub.switching:
                try:
                    hub.switch(choice)
                    gr.Info(f"Loaded {choice}. Every open page now shows it.")
                except Exception as e:      # a failed load keeps the old model serving
                    gr.Warning(f"Could not load {choice}: {e}")
            return sync(None)

        switch.input(on_switch, [switch, seen], sync_outputs, api_visibility="private",
                     concurrency_limit=1)
        gr.Timer(SYNC_S).tick(sync, seen, sync_outputs, api_visibility="private", queue=False,
                              show_progress="hidden", show_progress_on=[seen])
        # progress on a State (progress targets in views/live.py): the examples row here, as a
        # progress target, cost a live tab ~35 ms of the page's main thread per tick
        demo.load(sync, seen, sync_outputs, api_visibility="private", queue=False,
                  show_progress="hidden", show_progress_on=[seen])
        demo.unload(hub.on_unload)
    demo.queue(default_concurrency_limit=64)
    demo.hub = hub          # tests reach the shared engine state through this
    return demo


MAX_SESSIONS = 256      # Gradio sessions kept in memory (~260 KB each); the oldest go first


def _refreezing(switch):
    """hub.switch with the heap unfrozen around it: the old engine's objects (frozen at start)
    must be collectable once it is swapped out, and the new one's are frozen after."""
    import gc

    from engine.process_tuning import freeze_heap

    def run(choice: str) -> None:
        gc.unfreeze()
        try:
            switch(choice)
        finally:
            freeze_heap()
    return run


def launch(demo, host: str = "127.0.0.1", port: int | None = None, share: bool = False,
           prevent_thread_lock: bool = False, api_key: str | None = None, *,
           allowed_hosts: tuple[str, ...] = (), limits=None, public_traces: bool = False,
           allow_unauthenticated: bool = False, max_sessions: int = MAX_SESSIONS,
           cors=None, connections=None, root_path: str | None = None,
           log_level: str | None = None, isolate_prefix_cache: bool | None = None):
    """Launch with the app's stylesheet (Gradio 6 takes css at launch, not in Blocks), and the
    OpenAI-compatible routes (/v1/*) on the same server: Gradio builds its FastAPI app from
    `app_kwargs`, so the routes are there before the first request. `api_key`: None reads
    $GLASSBOX_API_KEY, then $VLLM_API_KEY. One guard (api.guard) stands in front of Gradio's
    routes and the API alike: Host allow-list and cross-site refusals (keyless), body size cap,
    and with a key every route needs it (a browser types it once on /login). Around the whole
    app: CORS for the API's routes (`cors`: api.cors.CORSSettings, vLLM's flags); below it,
    uvicorn's protocol with header, body and keep-alive deadlines and a connection cap
    (`connections`: api.connections.ConnectionLimits). `root_path`: vLLM's --root-path (a
    reverse proxy's path prefix); `log_level`: uvicorn's. Quiet: main() prints the address and
    the app's own hints (`--share`, not Gradio's `share=True`)."""
    from api import build_router, exposure_warning, resolve_api_key
    from api.auth import exposure_refusal
    from api.connections import ConnectionLimits, gradio_server
    from api.cors import APICors, api_path_matcher
    from api.errors import exception_handlers
    from api.limits import Limits, Pools
    from api.server import guard_middleware
    from views.live_plot import ALLOWED_PATHS
    api_key = resolve_api_key(api_key)
    refusal = exposure_refusal(host, api_key, share, allow_unauthenticated)
    if refusal:
        raise ValueError(refusal)
    warning = exposure_warning(host, api_key, share)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    limits = limits or Limits()
    pools = Pools(limits)
    hosts = tuple(allowed_hosts) + (("*.gradio.live",) if share else ())
    if isolate_prefix_cache is None:    # a shared server: users never share cached prefixes
        isolate_prefix_cache = api_key is not None or share or host not in (
            "127.0.0.1", "localhost", "::1")
    demo.hub.isolate_prefix_cache = isolate_prefix_cache      # the chat salts by session too
    routes = list(build_router(demo.hub, api_key, limits=limits, pools=pools,
                               public_traces=public_traces,
                               isolate_prefix_cache=isolate_prefix_cache).routes)
    is_api_path = api_path_matcher([r.path for r in routes])     # the rest are Gradio's
    app_kwargs = {"routes": routes, "exception_handlers": exception_handlers(),
                  "middleware": [guard_middleware(api_key, hosts, limits, pools, cors,
                                                  is_api_path)]}

    def outermost(app):
        return APICors(app, cors, keyed=api_key is not None, is_api_path=is_api_path)
    from engine.process_tuning import tune_process
    tune_process()          # a serving process: the GIL switch interval, the heap frozen
    with gradio_server(connections or ConnectionLimits(), outermost, log_level):
        return demo.launch(server_name=host, server_port=port, share=share,
                           prevent_thread_lock=prevent_thread_lock, css=CSS_PATH.read_text(),
                           max_threads=96, show_error=True, footer_links=["api", "gradio"],
                           quiet=True, allowed_paths=ALLOWED_PATHS, app_kwargs=app_kwargs,
                           state_session_capacity=max_sessions,
                           **({"root_path": root_path} if root_path else {}))


def check_port(host: str, port: int) -> None:
    """Exit with a clear message when host:port is taken: before the model loads, not after."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            sys.exit(f"cannot serve on {host}:{port}: {e.strerror or e}. Another program "
                     f"(maybe another Glassbox) uses it: pass a free one with --port, "
                     f"e.g. --port {port + 1}, or stop that program.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (api/cli.py): `python app.py [serve] [MODEL] [flags]`, Glassbox's flags
    and vLLM's `serve` flags with vLLM's meaning; a flag with no meaning here exits 2 with one
    line saying what to do instead."""
    from api.cli import parse
    return parse(argv, description=__doc__.splitlines()[0])


class Stages:
    """One progress line over the start-up stages, so no stage is silent."""

    def __init__(self, names: list[str]):
        from tqdm import tqdm
        self.bar = tqdm(total=len(names), bar_format="{desc:<58.58}{bar:20} {n}/{total} "
                                                     "{elapsed}")
        self.names = iter(names)

    def next(self) -> None:
        if self.bar.n or self.bar.desc:
            self.bar.update(1)
        self.bar.set_description(next(self.names, "ready"))

    def close(self) -> None:
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.set_description("ready")
        self.bar.close()


def load_llm(model: str, llm_kwargs: dict, stages: Stages | None = None):
    """Load the engine once (the first two start-up stages)."""
    stages = stages or Stages(["importing the engine (torch, transformers)", f"loading {model}"])
    stages.next()
    from engine import LLM
    stages.next()
    return LLM(model, **llm_kwargs)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # offline-friendly: no pings
    args = parse_args(argv)
    from api.cli import connection_limits, cors_settings, engine_kwargs, startup_notes
    from api.connections import raise_fd_limit
    note = startup_notes(args)
    if note:                    # vLLM flags that only tune vLLM: one line, then on
        print(note, flush=True)
    from api import resolve_api_key
    from api.auth import exposure_refusal
    refusal = exposure_refusal(args.host, resolve_api_key(args.api_key), args.share,
                               args.allow_unauthenticated)
    if refusal:                 # before the model loads
        sys.exit(refusal)
    check_port(args.host, args.port)
    raise_fd_limit()            # the connection cap, not the OS, bounds connections
    model, choices = switch_choices(args.model, args.no_model_switch)
    model, banner = resolve_model(model)
    llm_kwargs = dict(engine_kwargs(args), record_expert_load=True)
    if banner is not None and args.device in (None, "cpu") and args.num_kv_blocks is None:
        llm_kwargs["num_kv_blocks"] = 256   # the tiny fallback: a cache the map shows whole
    name = Path(model).name or model
    stages = Stages(["importing the engine (torch, transformers)",
                     f"loading {name} (weights, KV cache, kernels)",
                     "importing gradio and building the UI", f"starting the server on port "
                     f"{args.port}"])
    try:
        llm = load_llm(model, llm_kwargs, stages)
    except (ValueError, OSError, RuntimeError) as e:     # the engine's errors name the file
        stages.bar.close()
        sys.exit(f"could not load {model}: {e}")
    stages.next()
    shared = (resolve_api_key(args.api_key) is not None or args.share
              or args.host not in ("127.0.0.1", "localhost", "::1"))
    demo = build_app(llm, banner=banner, choices=choices, llm_kwargs=llm_kwargs,
                     allow_burst=not args.no_burst,
                     public_traces=args.public_traces or not shared,
                     served_model_names=tuple(args.served_model_name or ()))
    stages.next()
    from views.try_this import found_store
    found_store(demo.hub)       # on a demo: its Try-this search starts now, off the request path
    from api.limits import Limits
    limits = Limits(max_request_bytes=args.max_request_bytes,
                    max_stop_strings=args.max_stop_strings, max_stop_chars=args.max_stop_chars,
                    max_stop_token_ids=args.max_stop_token_ids, max_choices=args.max_choices,
                    max_logprob_entries=args.max_logprob_entries)
    try:
        _, url, share_url = launch(
            demo, args.host, args.port, args.share, prevent_thread_lock=True,
            api_key=args.api_key, limits=limits, public_traces=args.public_traces,
            isolate_prefix_cache=args.isolate_prefix_cache,
            allow_unauthenticated=args.allow_unauthenticated, max_sessions=args.max_sessions,
            allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
            cors=cors_settings(args), connections=connection_limits(args),
            root_path=args.root_path, log_level=args.uvicorn_log_level)
    except OSError as e:        # lost a race for the port since check_port
        llm.shutdown()
        sys.exit(f"cannot serve on {args.host}:{args.port}: {e}. Pass a free one with --port.")
    stages.close()
    print(f"Glassbox playground: {url}" + (f"  (public: {share_url})" if share_url else
                                          "  (add --share for a public gradio.live link)"),
          flush=True)
    print(f"OpenAI-compatible API: {url.rstrip('/')}/v1", flush=True)
    if resolve_api_key(args.api_key):
        print("Every route needs the key: scripts send 'Authorization: Bearer KEY'; a browser "
              "types it once on the login page.", flush=True)
    try:
        demo.block_thread()
    finally:
        demo.hub.shutdown()


if __name__ == "__main__":
    main()
