"""Chat tab: streaming chat with stop, system prompt and sampling controls, per-reply stats.

Each reply is one engine request (its own id), streamed with a ProbeSpec so the Layers tab can
show it. Stop, Clear and closing the tab abort the request in the engine; a cut reply says why.
The conversation itself lives in a gr.State as typed; the chat log shows an escaped copy, so no
message (user's or model's) is ever rendered as Markdown or HTML (a speculated reply: its
escaped text with the drafts marked by views/drafts.py). The same logic is exposed as the named
API endpoint `/chat` for gradio_client.
"""
from __future__ import annotations

import html
import math
from typing import Iterator, NamedTuple

import gradio as gr

from engine import ProbeSpec, SamplingParams
from views.chat_context import context_line, fit_conversation
from views.demo_tasks import DEMO_EXAMPLES, DEMO_NOTE, DEMO_PLACEHOLDER, is_demo_task
from views.drafts import CHAT_HELP as DRAFTS_HELP, DraftMarkup
from views.live import EngineHub

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly."
DEMO_SYSTEM = "You are Glassbox, a tiny demo model."    # one the demo models were trained with
MAX_MESSAGE_CHARS = 20_000
# the conversation so far goes with each message (the demos were trained on 1-3-turn chats);
# untick it to send a message alone
HISTORY_LABEL = ("send the conversation so far (off: each message alone; an example button "
                 "always sends its task alone)")
PATTERN_BYTES = 8 << 20     # the prompt's full attention pattern is kept when it fits this
BUSY = "A reply is still streaming: wait for it, or press Stop. Your message stays in the box."
SPECULATE_LABEL = "speculate: n-gram drafts, marked in the reply (off: the server's setting)"
MAX_CHAT_DRAFTS = 8         # draft tokens per step the chat offers


class ChatParts(NamedTuple):
    """Chat components the page-level model sync updates when the model changes."""
    max_tokens: gr.Slider
    temperature: gr.Slider
    system: gr.Textbox
    examples: gr.Row
    whatif: object = None       # views.interventions.WhatIf: the "What if" accordion's parts


def _text_of(content) -> str:
    """Gradio passes message content as a string or a list of parts; the engine wants text."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return content.get("text") or ""
    if isinstance(content, (list, tuple)):
        return "".join(_text_of(c) for c in content)
    return str(content or "")


def build_messages(system: str, history: list[dict], message: str) -> list[dict]:
    if system is not None and not isinstance(system, str):    # /chat's API: any JSON arrives
        raise ValueError(f"the system prompt must be a string, got {type(system).__name__}")
    msgs = [{"role": "system", "content": system.strip()}] if system and system.strip() else []
    msgs += [{"role": m["role"], "content": _text_of(m["content"])} for m in history
             if m.get("role") in ("user", "assistant")]
    return msgs + [{"role": "user", "content": message}]


def prompt_counter(llm):
    """Messages -> prompt tokens, as the engine will encode them; None without a chat
    template (then nothing is trimmed and the engine's own error speaks)."""
    tok = llm.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        return None
    from engine.prompt import encode_chat
    return lambda msgs: len(encode_chat(tok, msgs)[0])


def fit_messages(llm, system: str, history: list[dict], message: str, max_tokens: int):
    """build_messages, trimmed to the model's context (views/chat_context.py): (messages,
    turns dropped, prompt tokens or None, reply budget)."""
    msgs = build_messages(system, history, message)
    count = prompt_counter(llm)
    if count is None:
        return msgs, 0, None, max_tokens
    sys_msgs = msgs[:1] if msgs[0]["role"] == "system" else []
    fitted = fit_conversation(sys_msgs, msgs[len(sys_msgs):-1], msgs[-1], max_tokens,
                              int(llm.max_model_len), count)
    return fitted


def display(history: list[dict]) -> list[dict]:
    """The chat log's copy of the conversation: every message escaped, so `<img onerror>`,
    `<script>` and `__init__` show exactly as typed (a speculated reply: its escaped text with
    the drafts marked, views/drafts.py); a cut reply ends with why it stopped."""
    out = []
    for m in history:
        text = m.get("marked") or html.escape(_text_of(m["content"]), quote=False)
        if m.get("cut"):
            text += f"\n\n(reply cut: {html.escape(m['cut'], quote=False)})"
        out.append({"role": m["role"], "content": text})
    return out


def check_message(message: str | None) -> str:
    """The message, or a ValueError that says what to fix."""
    if message is not None and not isinstance(message, str):
        raise ValueError(f"the message must be a string, got {type(message).__name__}")
    message = (message or "").strip()
    if not message:
        raise ValueError("Type a message first: it is empty.")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ValueError(f"The message is {len(message):,} characters; the limit is "
                         f"{MAX_MESSAGE_CHARS:,}. Shorten it.")
    return message


def make_sampling(temperature, top_p, top_k, max_tokens, ignore_eos=False,
                  num_speculative_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from UI/API values; bad values raise ValueError with the reason.
    num_speculative_tokens: None = the server's setting, k = up to k n-gram drafts a step."""
    if any(isinstance(v, bool) for v in (temperature, top_p, top_k, max_tokens)):
        raise ValueError("temperature, top_p, top_k and max_tokens must be numbers, not "
                         "true/false")          # float(True) would quietly be 1.0
    try:
        t, p, k, n = float(temperature), float(top_p), int(top_k), int(max_tokens)
    except (TypeError, ValueError, OverflowError):      # OverflowError: int(inf)
        raise ValueError("temperature, top_p, top_k and max_tokens must be numbers") from None
    if n < 1:
        raise ValueError(f"max tokens must be at least 1, got {n}")
    if t < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {t}")
    return SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=n,
                          ignore_eos=bool(ignore_eos),
                          num_speculative_tokens=num_speculative_tokens)


def speculative_tokens(on, k) -> int | None:
    """The chat's speculate controls as SamplingParams.num_speculative_tokens."""
    if not on:
        return None
    try:
        k = int(k)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"draft tokens per step must be a whole number, got {k!r}") from None
    if not 1 <= k <= MAX_CHAT_DRAFTS:
        raise ValueError(f"draft tokens per step must be in 1..{MAX_CHAT_DRAFTS}, got {k}")
    return k


def watch_spec(hf_config) -> ProbeSpec:
    """Every probe, plus the prompt's full attention pattern for every layer when it stays
    under PATTERN_BYTES (so scrubbing to a prompt token shows that token's attention)."""
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    cap = int(math.sqrt(PATTERN_BYTES / (4 * layers * heads)))
    return ProbeSpec(prefill_pattern_layers=tuple(range(layers)), prefill_pattern_cap=max(1, cap))


def finish_note(ev, max_model_len: int, reason: str | None = None) -> str:
    """Why the reply ended, in words."""
    m = ev.metrics or {}
    if ev.finish_reason == "abort":
        return f"cut: {reason or 'aborted'}"
    if ev.finish_reason == "length":
        used = (m.get("num_prompt_tokens") or 0) + (m.get("num_output_tokens") or 0)
        if used >= max_model_len:
            return f"stopped at the model's limit of {max_model_len} tokens (prompt included)"
        return "stopped at max tokens"
    return "finished (end of reply)"


def format_stats(ev, note: str) -> str:
    m = ev.metrics or {}
    parts = []
    if m.get("ttft_s") is not None:
        parts.append(f"TTFT **{1e3 * m['ttft_s']:.0f} ms**")
    if m.get("tok_s") is not None:
        parts.append(f"**{m['tok_s']:.1f}** tok/s")
    n = m.get("prefix_cached_blocks", 0)
    parts.append(f"**{n}** prefix-cache block{'' if n == 1 else 's'} reused")
    parts.append(f"{m.get('num_output_tokens', 0)} tokens")
    sd = m.get("spec_decode")
    if sd and sd["num_draft_tokens"]:     # speculative decoding: how much of its drafting paid
        parts.append(f"**{sd['num_accepted_tokens']}** of {sd['num_draft_tokens']} drafted "
                     f"tokens accepted ({sd['num_drafts']} verifies)")
    parts.append(note)
    return f"`{ev.request_id}` · " + " · ".join(parts)


def stream_reply(hub: EngineHub, session_key: str | None, messages, sampling, watch: bool
                 ) -> Iterator:
    """The engine's stream of a request checked by its processor (a refusal raises here, before
    anything is registered), registered to its browser session (for stop / tab close)."""
    sess = hub.session(session_key)
    client = hub.current()
    spec = watch_spec(client.hf_config) if watch else None
    request = client.processor.process(messages, sampling, watch=spec,
                                       request_id=hub.new_request_id("chat"),
                                       cache_salt=hub.session_salt(session_key))
    rid = request.request_id
    events = client.stream(request)
    if watch:
        sess.watched = rid
        sess.replies.append(rid)
    sess.active.add(rid)
    try:
        yield from events
    finally:   # normal end, abort, or the generator closed by a cancelled event
        sess.active.discard(rid)
        if not sess.active and sess.watched is None:   # API callers never unload: forget them
            hub.sessions.pop(session_key or "anonymous", None)


def build(hub: EngineHub) -> ChatParts:
    """The chat column and its events, inside the caller's gr.Blocks."""
    demo = hub.is_demo()
    llm = hub.llm
    conversation = gr.State([])     # the messages as typed / generated: the model's history
    noted = gr.State(False)         # the demo's "what I was trained on" note was shown
    with gr.Row():
        with gr.Column(scale=3):
            gr.Markdown("Each reply is one engine request, streamed token by token; the other "
                        "tabs show its internals live (Layers follows your latest reply).",
                        elem_classes=["gb-help"], elem_id="chat-help")
            drafts_help = gr.Markdown(DRAFTS_HELP, visible=False, elem_id="chat-drafts-help")
            # the log grows with the window but leaves the first screen (900 px) room for the
            # message box, its buttons, the reply's stats, the notes and the "What if" header
            chatbot = gr.Chatbot(elem_id="chat-log", height="max(260px, calc(100vh - 600px))",
                                 show_label=False,
                                 render_markdown=False, latex_delimiters=[], buttons=[],
                                 feedback_options=None,
                                 placeholder="Say something: the reply streams from the engine, "
                                             "and the other tabs show its internals live.")
            with gr.Row(visible=demo, elem_id="chat-examples") as examples:
                gr.Markdown("Try a task the demo model was trained on (sent alone):",
                            elem_id="chat-examples-label")
                example_buttons = [gr.Button(text, size="sm", variant="secondary",
                                             elem_id=f"chat-example-{i}", min_width=60)
                                   for i, text in enumerate(DEMO_EXAMPLES)]
            with gr.Row():
                box = gr.Textbox(placeholder=DEMO_PLACEHOLDER if demo else "Message",
                                 show_label=False, scale=6, elem_id="chat-input",
                                 autofocus=True, max_lines=6)
                # wide enough for its busy label ("Generating…") at 1024 px
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send",
                                 min_width=120)
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="chat-stop",
                                 min_width=80)
                clear = gr.Button("Clear", scale=1, elem_id="chat-clear", min_width=80)
            stats = gr.Markdown("", elem_id="chat-stats")
            context = gr.Markdown(context_line(llm.max_model_len, min(128, max_tokens_limit(llm))),
                                  elem_id="chat-context")
            note = gr.Markdown("", elem_id="chat-note")
        with gr.Column(scale=1, min_width=260):
            system = gr.Textbox(DEMO_SYSTEM if demo else DEFAULT_SYSTEM, label="System prompt",
                                lines=3, elem_id="chat-system")
            temperature = gr.Slider(0, 2, 0.0 if demo else 0.7, step=0.05,
                                    label="temperature (0 = greedy)", elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1, 1.0, step=0.05, label="top_p", elem_id="chat-top-p")
            top_k = gr.Slider(0, 200, 0, step=1, label="top_k (0 = off)", elem_id="chat-top-k")
            max_tokens = gr.Slider(1, max_tokens_limit(llm), min(128, max_tokens_limit(llm)),
                                   step=1, label=max_tokens_label(llm),
                                   elem_id="chat-max-tokens")
            ignore_eos = gr.Checkbox(False, label="ignore EOS (run to max tokens)",
                                     elem_id="chat-ignore-eos")
            keep_history = gr.Checkbox(True, label=HISTORY_LABEL, elem_id="chat-history")
            with gr.Row(equal_height=True):
                speculate = gr.Checkbox(False, label=SPECULATE_LABEL, elem_id="chat-speculate",
                                        scale=3)
                spec_k = gr.Number(4, minimum=1, maximum=MAX_CHAT_DRAFTS, step=1, precision=0,
                                   label="drafts a step", elem_id="chat-spec-k", scale=1,
                                   min_width=90)
    from views import interventions     # "what if": the same message re-run with an edit
    whatif = interventions.build(hub, conversation, box, system, max_tokens)

    def respond(message, history, system, temperature, top_p, top_k, max_tokens, ignore_eos,
                keep, noted_before, spec_on, k, request: gr.Request, alone: bool = False):
        key = request.session_hash if request else None
        history = list(history or [])
        before = list(history)
        sess = hub.sessions.get(key or "anonymous")
        skip = [gr.skip()] * 7
        if sess is not None and any(r.startswith("chat-") for r in sess.active):
            gr.Warning(BUSY)
            yield [gr.skip()] * 8
            return
        try:
            message = check_message(message)
            sampling = make_sampling(temperature, top_p, top_k, max_tokens, ignore_eos,
                                     speculative_tokens(spec_on, k))
            llm = hub.llm
            sent, dropped, n_prompt, budget = fit_messages(
                llm, system, history if keep and not alone else [], message, sampling.max_tokens)
            ctx = context_line(llm.max_model_len, budget, n_prompt, dropped)
            # a free prompt on a demo: the model's answer, plus (once) what the demo can do
            show_note = hub.is_demo() and not noted_before and not is_demo_task(message)
            note_out = DEMO_NOTE if show_note else gr.skip()
            noted_now = True if show_note else gr.skip()
            events = stream_reply(hub, key, sent, sampling, watch=True)
            ev = None
            history = history + [{"role": "user", "content": message},
                                 {"role": "assistant", "content": ""}]
            yield (display(history), history, "", "generating…", busy_send(), ctx, note_out,
                   noted_now)
            marks = None        # the drafts marked, from the reply's first verify on
            for ev in events:
                if marks is None and ev.draft is not None:
                    marks = DraftMarkup(hub.decode, history[-1]["content"])
                if marks is not None:
                    marks.add(ev)
                    history[-1]["marked"] = marks.html()
                history[-1]["content"] = ev.output_text
                if not ev.finished:
                    yield [display(history)] + skip
            if ev is None:
                yield display(before), before, gr.skip(), "", idle_send(), gr.skip(), \
                    gr.skip(), gr.skip()
                return
            reason = hub.abort_reason(ev.request_id) if ev.finish_reason == "abort" else None
            if reason == CLEARED:            # Clear emptied the chat: leave it empty
                yield [], [], gr.skip(), "", idle_send(), gr.skip(), gr.skip(), gr.skip()
                return
            if reason:
                history[-1]["cut"] = reason
            done = finish_note(ev, hub.llm.max_model_len, reason)
            if alone and keep:
                done += " · sent alone (an example is its own conversation)"
            yield (display(history), history, gr.skip(), format_stats(ev, done), idle_send(),
                   gr.skip(), gr.skip(), gr.skip())
        except ValueError as e:      # bad input: say so, keep the conversation as it was
            gr.Warning(str(e))
            yield (display(before), before, gr.skip(), f"**Not sent:** {e}", idle_send(),
                   gr.skip(), gr.skip(), gr.skip())
        except RuntimeError as e:    # the engine failed or was shut down under this reply
            gr.Warning(str(e))
            if history and history[-1]["role"] == "assistant":
                history[-1]["cut"] = str(e)
            yield (display(history), history, gr.skip(), f"**Reply failed:** {e}", idle_send(),
                   gr.skip(), gr.skip(), gr.skip())

    def respond_alone(message, history, system, temperature, top_p, top_k, max_tokens,
                      ignore_eos, keep, noted_before, spec_on, k, request: gr.Request):
        yield from respond(message, history, system, temperature, top_p, top_k, max_tokens,
                           ignore_eos, keep, noted_before, spec_on, k, request, alone=True)

    inputs = [box, conversation, system, temperature, top_p, top_k, max_tokens, ignore_eos,
              keep_history, noted, speculate, spec_k]
    outputs = [chatbot, conversation, box, stats, send, context, note, noted]
    # one dependency for Enter and Send: a second message while a reply streams is ignored
    # (trigger_mode "once"), and stays in the box; Send shows it is disabled meanwhile
    # show_progress_on a State: see progress targets in views/live.py; with the chatbot among the
    # progress targets a live tab's every tick copied the whole conversation (Engine 4.2 ->
    # 1.7 updates/s as a reply grew). The stats line says "generating…" instead of the
    # chatbot's pending dots.
    gr.on([box.submit, send.click], respond, inputs, outputs, api_visibility="private",
          show_progress="hidden", show_progress_on=[conversation], trigger_mode="once")
    # an example is sent alone: each of the demo's tasks answers as trained whatever came
    # before (the dense demo misses some tasks asked after another one in one conversation)
    for btn, text in zip(example_buttons, DEMO_EXAMPLES):
        btn.click(lambda text=text: text, None, box, api_visibility="private",
                  queue=False, show_progress="hidden", show_progress_on=[conversation]).then(
            respond_alone, inputs, outputs, api_visibility="private", show_progress="hidden",
            show_progress_on=[conversation])

    def on_stop(request: gr.Request):
        """Abort in the engine; the reply's own handler writes the stats line ("cut: stopped
        by user") when its stream ends. Stop writes nothing there itself: its answer could
        arrive after the reply's last update and leave a stale "stopping…" for good."""
        hub.abort_session(request.session_hash if request else None, "stopped by user")

    stop.click(on_stop, None, None, api_visibility="private", queue=False)
    # the legend of the marks shows while speculation is on
    speculate.change(lambda on: gr.Markdown(visible=bool(on)), speculate, drafts_help,
                     api_visibility="private", queue=False, show_progress="hidden",
                     show_progress_on=[conversation])

    def on_clear(request: gr.Request):
        hub.abort_session(request.session_hash if request else None, CLEARED)
        return [], [], "", idle_send()

    # no `cancels`: the aborted reply's own handler ends with an empty chat (CLEARED), so its
    # last word is always the empty one; cancelling it could leave a streamed update that
    # arrived after Clear's on the page
    # the chat log's own clear (bin) icon empties only the log on the page: the conversation
    # (what the next message sends) must go with it, so it is the Clear button's twin
    gr.on([clear.click, chatbot.clear], on_clear, None, [chatbot, conversation, stats, send],
          api_visibility="private", queue=False, show_progress="hidden",
          show_progress_on=[conversation])

    def chat(message: str, system_prompt: str | None = None, temperature: float | None = None,
             max_tokens: int = 128, ignore_eos: bool = False,
             request: gr.Request = None) -> Iterator[str]:
        """Stream the reply to one message; yields the growing reply text. None for the system
        prompt or temperature means the playground's defaults (on the demo models: their
        trained system prompt, greedy); "" sends no system prompt. A reply cut before its end
        (Stop, a model switch, shutdown) ends with an error that says why, never as a normal
        result."""
        try:
            message = check_message(message)
            demo = hub.is_demo()
            t = temperature if temperature is not None else (0.0 if demo else 0.7)
            if system_prompt is None:
                system_prompt = DEMO_SYSTEM if demo else DEFAULT_SYSTEM
            sampling = make_sampling(t, 1.0, 0, max_tokens, ignore_eos)
            events = stream_reply(hub, request.session_hash if request else None,
                                  build_messages(system_prompt, [], message), sampling,
                                  watch=False)
            for ev in events:
                if ev.finished and ev.finish_reason == "abort":
                    reason = hub.abort_reason(ev.request_id)
                    raise gr.Error(f"The reply was cut after {len(ev.output_text)} characters: "
                                   f"{reason}.")
                yield ev.output_text
        except ValueError as e:
            raise gr.Error(str(e)) from None
        except RuntimeError as e:
            raise gr.Error(f"The reply was cut: {e}") from None

    gr.api(chat, api_name="chat", concurrency_limit=64)
    return ChatParts(max_tokens, temperature, system, examples, whatif)


CLEARED = "the chat was cleared"


def idle_send():
    return gr.Button("Send", interactive=True)


def busy_send():
    return gr.Button("Generating…", interactive=False)


def max_tokens_limit(llm) -> int:
    """The longest reply the model allows: its max_model_len less one prompt token."""
    return max(1, int(llm.max_model_len) - 1)


def max_tokens_label(llm) -> str:
    return f"max tokens (this model: {llm.max_model_len} with the prompt)"
