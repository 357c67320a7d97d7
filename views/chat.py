"""Chat tab: streaming chat with stop, system prompt and sampling controls, per-reply stats.

Each reply is one engine request (its own id), streamed with `watch=ProbeSpec()` so the Layers
tab can show it. Stop, and closing the tab, abort the request in the engine. The same logic is
exposed as the named API endpoint `/chat` for gradio_client.
"""
from __future__ import annotations

from typing import Iterator

import gradio as gr

from engine import ProbeSpec, SamplingParams
from views.live import EngineHub

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly."
MAX_MESSAGE_CHARS = 20_000


def _text_of(content) -> str:
    """Gradio 6 passes message content as a list of parts; the engine wants plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text") or ""
    if isinstance(content, (list, tuple)):
        return "".join(_text_of(c) for c in content)
    return str(content or "")


def build_messages(system: str, history: list[dict], message: str) -> list[dict]:
    msgs = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    msgs += [{"role": m["role"], "content": _text_of(m["content"])} for m in history
             if m.get("role") in ("user", "assistant")]
    return msgs + [{"role": "user", "content": message}]


def check_message(message: str | None) -> str:
    """The message, or a ValueError that says what to fix."""
    message = (message or "").strip()
    if not message:
        raise ValueError("Type a message first: it is empty.")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ValueError(f"The message is {len(message):,} characters; the limit is "
                         f"{MAX_MESSAGE_CHARS:,}. Shorten it.")
    return message


def make_sampling(temperature, top_p, top_k, max_tokens, ignore_eos=False) -> SamplingParams:
    """SamplingParams from UI/API values; bad values raise ValueError with the reason."""
    try:
        t, p, k, n = float(temperature), float(top_p), int(top_k), int(max_tokens)
    except (TypeError, ValueError):
        raise ValueError("temperature, top_p, top_k and max_tokens must be numbers") from None
    if n < 1:
        raise ValueError(f"max tokens must be at least 1, got {n}")
    return SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=n,
                          ignore_eos=bool(ignore_eos))


def format_stats(ev) -> str:
    m = ev.metrics or {}
    parts = []
    if m.get("ttft_s") is not None:
        parts.append(f"TTFT **{1e3 * m['ttft_s']:.0f} ms**")
    if m.get("tok_s") is not None:
        parts.append(f"**{m['tok_s']:.1f}** tok/s")
    n = m.get("prefix_cached_blocks", 0)
    parts.append(f"**{n}** prefix-cache block{'' if n == 1 else 's'} reused")
    parts.append(f"{m.get('num_output_tokens', 0)} tokens")
    parts.append(f"finish: `{ev.finish_reason}`")
    return f"`{ev.request_id}` · " + " · ".join(parts)


def stream_reply(hub: EngineHub, session_key: str | None, messages, sampling, watch: bool
                 ) -> Iterator:
    """llm.stream with the request registered to its browser session (for stop / tab close)."""
    sess = hub.session(session_key)
    rid = hub.new_request_id("chat")
    if watch:
        sess.watched = rid
    sess.active.add(rid)
    try:
        yield from hub.llm.stream(messages, sampling, watch=ProbeSpec() if watch else None,
                                  request_id=rid)
    finally:   # normal end, abort, or the generator closed by a cancelled event
        sess.active.discard(rid)
        if not sess.active and sess.watched is None:   # API callers never unload: forget them
            hub.sessions.pop(session_key or "anonymous", None)


def build(hub: EngineHub) -> None:
    """The chat column and its events, inside the caller's gr.Blocks."""
    with gr.Row():
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(elem_id="chat-log", height=440, show_label=False,
                                 buttons=["copy"], feedback_options=None,
                                 placeholder="Say something: the reply streams from the engine, "
                                             "and the other tabs show its internals live.")
            with gr.Row():
                box = gr.Textbox(placeholder="Message", show_label=False, scale=6,
                                 elem_id="chat-input", autofocus=True, max_lines=6)
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send",
                                 min_width=80)
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop",
                                 min_width=80)
                clear = gr.Button("Clear", scale=1, elem_id="chat-clear", min_width=80)
            stats = gr.Markdown("", elem_id="chat-stats")
        with gr.Column(scale=1, min_width=260):
            system = gr.Textbox(DEFAULT_SYSTEM, label="System prompt", lines=3,
                                elem_id="chat-system")
            temperature = gr.Slider(0, 2, 0.7, step=0.05, label="temperature (0 = greedy)",
                                    elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1, 1.0, step=0.05, label="top_p", elem_id="chat-top-p")
            top_k = gr.Slider(0, 200, 0, step=1, label="top_k (0 = off)", elem_id="chat-top-k")
            max_tokens = gr.Slider(1, 1024, 128, step=1, label="max tokens",
                                   elem_id="chat-max-tokens")
            ignore_eos = gr.Checkbox(False, label="ignore EOS (run to max tokens)",
                                     elem_id="chat-ignore-eos")

    def respond(message, history, system, temperature, top_p, top_k, max_tokens, ignore_eos,
                request: gr.Request):
        history = list(history or [])
        try:
            message = check_message(message)
            sampling = make_sampling(temperature, top_p, top_k, max_tokens, ignore_eos)
            messages = build_messages(system, history, message)
            events = stream_reply(hub, request.session_hash if request else None, messages,
                                  sampling, watch=True)
            history.append({"role": "user", "content": message})
            history.append({"role": "assistant", "content": ""})
            yield history, "", "generating…"
            for ev in events:
                history[-1]["content"] = ev.output_text
                if ev.finished:
                    yield history, "", format_stats(ev)
                else:
                    yield history, gr.skip(), gr.skip()
        except ValueError as e:      # bad input: say so, keep the conversation as it was
            gr.Warning(str(e))
            if history and history[-1]["role"] == "assistant" and not history[-1]["content"]:
                history = history[:-2]
            yield history, gr.skip(), f"⚠️ {e}"
        except RuntimeError as e:    # the engine failed or was swapped out under this reply
            gr.Warning(str(e))
            yield history, gr.skip(), f"⚠️ {e}"

    inputs = [box, chatbot, system, temperature, top_p, top_k, max_tokens, ignore_eos]
    outputs = [chatbot, box, stats]
    ev_submit = box.submit(respond, inputs, outputs, api_visibility="private",
                           show_progress="hidden")
    ev_send = send.click(respond, inputs, outputs, api_visibility="private",
                         show_progress="hidden")

    def on_stop(request: gr.Request):
        n = hub.abort_session(request.session_hash if request else None)
        return "stopped" if n else gr.skip()

    stop.click(on_stop, None, stats, cancels=[ev_submit, ev_send], api_visibility="private",
               queue=False)
    clear.click(lambda: ([], ""), None, [chatbot, stats], api_visibility="private", queue=False)

    def chat(message: str, system_prompt: str = DEFAULT_SYSTEM, temperature: float = 0.7,
             max_tokens: int = 128, ignore_eos: bool = False,
             request: gr.Request = None) -> Iterator[str]:
        """Stream the reply to one message; yields the growing reply text."""
        try:
            message = check_message(message)
            sampling = make_sampling(temperature, 1.0, 0, max_tokens, ignore_eos)
            events = stream_reply(hub, request.session_hash if request else None,
                                  build_messages(system_prompt, [], message), sampling,
                                  watch=False)
            for ev in events:
                yield ev.output_text
        except ValueError as e:
            raise gr.Error(str(e)) from None

    gr.api(chat, api_name="chat", concurrency_limit=64)
