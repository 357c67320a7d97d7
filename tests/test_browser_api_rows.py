"""Headless Chromium on the KV tab while an API client streams: the request's row under its
block table shows what the client chose (sampling), what the grammar does (masked steps, the
last mask's size) and the API's note, as a person watching the server sees them."""
import threading

import pytest

from test_browser import browser, open_app, running, show_tab, wait_js  # noqa: F401
from ui_helpers import wait_until

pytestmark = pytest.mark.slow
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
          "minItems": 400}       # never done within the reply: every step is masked


def test_an_api_requests_row_shows_its_sampling_grammar_and_note(running, browser):  # noqa: F811
    from openai import OpenAI
    client = OpenAI(base_url=running.url + "v1", api_key="none", max_retries=0, timeout=120)
    page = open_app(browser, running.url)
    show_tab(page, "kv")
    ids: list[str] = []
    done = threading.Event()

    def stream():
        try:
            for chunk in client.chat.completions.create(
                    model=running.llm.model_name, stream=True, max_tokens=450,
                    temperature=0.4, presence_penalty=0.5,
                    messages=[{"role": "user", "content": "Numbers, please."}],
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "numbers", "schema": SCHEMA}},
                    extra_headers={"X-Request-Id": "api-rows-watch"}):
                ids.append(chunk.id)
                if done.is_set():
                    break
        finally:
            done.set()
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        # the engine knows the request under the server's id (the chunks' id), never the
        # client's X-Request-Id; the API's note is put on it the way it puts parsed tool calls
        def live_id():
            snap = running.hub.snapshot(max_age=0)
            return next((r for r in snap.running if ids and r == ids[0]), None)
        engine_id = wait_until(live_id, timeout=60)
        running.llm.annotate(engine_id, "tool calls: lookup({\"q\": \"<b>x</b>\"})")
        row = f"#kv-tables .kv-trow[data-request='{engine_id}']"
        wait_js(page, "(sel) => { const r = document.querySelector(sel); if (!r) return false;"
                      " const t = r.innerText;"
                      " return /grammar: [1-9]\\d* masked steps/.test(t) && t.includes('tool calls'); }",
                row, "the request's row with its grammar state and note")
        text = page.locator(row).inner_text()
        assert "temp 0.4" in text and "presence 0.5" in text and "max 450" in text
        assert "tokens masked" in text
        # the note's markup is text, not HTML
        assert "<b>x</b>" in text and page.locator(f"{row} b").count() == 0
    finally:
        done.set()
        running.llm.abort(engine_id) if "engine_id" in locals() else None
        t.join(timeout=30)
        page.context.close()
