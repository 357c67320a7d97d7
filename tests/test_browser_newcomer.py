"""The playground as a newcomer meets it (issue 28), in headless Chromium on the shared app:
a conversation that outgrows the context keeps going (oldest turns left out, said in one
line) and a message too long to fit alone is refused without an empty bubble; the demo's
examples answer right in any order and a free prompt gets the note of what the demo can do;
Stop leaves a final stats line; a new page's Layers tab waits for its own reply (everyone's
is one choice away); the KV map's click and hover card stay in view at 1024×768; the Engine
tab on the CPU shows the batch, the history and latency percentiles; Anatomy folds into two
screens."""
import time

import pytest

from test_browser import (bot_text, browser, open_app, quiet_context, running,  # noqa: F401
                          send, set_number, show_tab, wait_js)
from ui_helpers import wait_until

pytestmark = pytest.mark.slow


def reply_done(page, n):
    wait_until(lambda: page.locator("[data-testid=bot]").count() == n, timeout=90)
    wait_js(page, "() => !document.querySelector('#chat-send').disabled", what="reply to end")


def stats(page) -> str:
    return page.inner_text("#chat-stats")


def test_a_conversation_outgrows_the_context_and_keeps_going(running, browser):
    page = open_app(browser, running.url)
    limit = running.llm.max_model_len
    assert str(limit) in page.inner_text("#chat-context")          # shown before any message
    for i in range(3):      # three long replies cannot all fit in one prompt with a reply
        send(page, f"Tell me about lists, part {i}.", limit // 3)
        reply_done(page, i + 1)
    ctx = page.inner_text("#chat-context")
    assert "oldest turn" in ctx and "left out" in ctx, ctx
    assert bot_text(page).strip(), "the third reply is empty"
    # a message that cannot fit even alone: a clear message, and no empty reply bubble
    send(page, " ".join(["word"] * (limit + 50)), 8)
    wait_js(page, "() => document.querySelector('#chat-stats').textContent"
                  ".includes('too long')", what="the too-long message's explanation")
    assert page.locator("[data-testid=bot]").count() == 3
    assert page.locator("[data-testid=user]").count() == 3
    page.context.close()


def test_examples_answer_right_in_any_order_and_a_free_prompt_gets_the_note(running, browser):
    if not running.hub.is_demo():
        pytest.skip("no bundled demo checkpoint")
    page = open_app(browser, running.url)
    assert "What is 2+3?" in page.get_attribute("#chat-input textarea", "placeholder")
    page.click("#chat-example-0")                   # What is 47+38?
    reply_done(page, 1)
    page.click("#chat-example-4")                   # Sort: 42 7 19 3, right after it
    reply_done(page, 2)
    answers = [e.inner_text().strip() for e in page.locator("[data-testid=bot]").all()]
    assert answers == ["85", "3 7 19 42"], answers
    assert page.inner_text("#chat-note").strip() == ""
    send(page, "hi", 8, ignore_eos=False)
    reply_done(page, 3)
    note = page.inner_text("#chat-note")
    assert "trained only on" in note and "--model" in note, note
    page.context.close()


def test_stop_leaves_the_reply_stats_not_stopping(running, browser):
    page = open_app(browser, running.url)
    send(page, "Write a very long list of colours, one per line.", 400)
    wait_until(lambda: len(bot_text(page)) > 5, timeout=60)
    show_tab(page, "engine")                        # Stop pressed with another tab shown last
    show_tab(page, "chat")
    page.click("#chat-stop")
    wait_js(page, "() => document.querySelector('#chat-stats').textContent"
                  ".includes('stopped by user')", what="the cut reply's stats")
    time.sleep(1.5)
    assert "stopping" not in stats(page), stats(page)
    page.context.close()


def test_layers_follow_this_pages_own_reply_and_server_wide_is_one_click(running, browser):
    a, b = open_app(browser, running.url), open_app(browser, running.url)
    send(a, "Copy: glass box", 12)
    reply_done(a, 1)
    show_tab(b, "layers")
    wait_js(b, "() => document.querySelector('#layers-status').textContent"
               ".includes('no message yet')", what="page B waiting for its own reply")
    b.click("#layers-request input")
    b.get_by_role("option", name="server-wide", exact=False).first.click()
    wait_js(b, "() => document.querySelector('#layers-status').textContent"
               ".includes('Watching')", what="server-wide: A's reply")
    # A's own Layers tab: its reply; once finished, the slider ends at its last token
    show_tab(a, "layers")
    wait_js(a, "() => document.querySelector('#layers-status').textContent.includes('finished')",
            what="A's finished reply")
    rid = running.hub.sessions[next(k for k, s in running.hub.sessions.items()
                                    if s.watched)].watched
    t = len(running.llm.trace(rid).resid_norms)
    wait_js(a, "(t) => +document.querySelector('#layers-token input[type=range]').max === t - 1",
            t, f"the slider to end at token {t - 1}")
    # ~40 keys: the heads chart's rotated key labels are thinned to what fits
    wait_js(a, "() => +(document.querySelector('#layers-heads .gb-chart').dataset.labelEvery"
               " || 0) >= 2", what="thinned key labels")
    a.context.close()
    b.context.close()


def test_kv_click_and_hover_card_stay_in_view_at_1024x768(running, browser):
    page = quiet_context(browser, 1024, 768).new_page()
    page.set_default_timeout(60_000)
    page.goto(running.url)
    page.wait_for_selector("#chat-input textarea")
    send(page, "Write a very long list of colours, one per line.", 900)
    wait_until(lambda: len(bot_text(page)) > 5, timeout=60)
    show_tab(page, "kv")
    wait_js(page, "() => +(document.querySelector('#kv-grid .kv-map') || {dataset: {}})"
                  ".dataset.draws > 0", what="the map")
    # the legend's owned swatch shows the colours of requests drawn, not a fixed blue: read
    # while the reply holds blocks (on a fast machine it can end soon after the tab opens)
    wait_js(page, "() => { const s = document.querySelector('#kv-grid .kv-swatch.kv-owned');"
                  " return s && (s.getAttribute('style') || '').includes('linear-gradient'); }",
            what="the owned swatch in the drawn requests' colours")
    snap = running.hub.snapshot(max_age=0)
    owned = [b.block_id for b in snap.blocks if b.owners] or [0]
    page.locator("#kv-grid canvas").scroll_into_view_if_needed()
    # hover the last cell drawn (right edge): the card stays inside the window
    last = max(owned)
    xy = page.evaluate("(id) => document.querySelector('#kv-grid .kv-map').kvCellCenter(id)",
                       last)
    page.mouse.move(xy["x"], xy["y"])
    wait_js(page, "() => getComputedStyle(document.querySelector('.kv-tip')).display === "
                  "'block'", what="the hover card")
    box = page.evaluate("() => { const r = document.querySelector('.kv-tip')"
                        ".getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }")
    assert box[0] >= 0 and box[1] >= 0 and box[2] <= 1024 and box[3] <= 768, box
    page.mouse.click(xy["x"], xy["y"])
    wait_js(page, "() => { const r = document.getElementById('kv-drill')"
                  ".getBoundingClientRect(); return r.top >= 0 && r.top < innerHeight; }",
            what="the drilldown scrolled into view")
    page.context.close()


def test_engine_tab_on_the_cpu_and_anatomy_in_two_screens(running, browser):
    page = open_app(browser, running.url)
    send(page, "Copy: glass box", 12)
    reply_done(page, 1)
    show_tab(page, "engine")
    from test_browser import plot_rendered
    plot_rendered(page, "engine-graphs", "CPU: no CUDA graphs")
    plot_rendered(page, "engine-history", "Engine history")
    wait_js(page, "() => document.querySelector('#engine-latency').textContent.includes('p99')",
            what="latency percentiles")
    assert page.inner_text("#engine-help").startswith("What this shows")
    show_tab(page, "anatomy")
    page.wait_for_selector("#anatomy-sec-1")
    time.sleep(1.0)
    height = page.evaluate("() => document.documentElement.scrollHeight")
    assert height <= 2 * 1000, f"the Anatomy tab is {height} px tall"
    page.context.close()


def test_reply_speed_with_the_layers_tab_open_vs_hidden(running, browser):
    """A measurement (printed, not asserted: the machine's load varies): the chat reply's own
    tok/s with the Layers tab open, against the same reply with the chat tab shown. Target
    (issue 28): >= 80 %."""
    import re
    import statistics
    page = open_app(browser, running.url)
    page.locator("#chat-history input").set_checked(False)    # the same prompt every time
    speeds = {"hidden": [], "layers": []}
    for where in ("hidden", "layers") * 3:
        show_tab(page, "chat")
        n = page.locator("[data-testid=bot]").count()
        send(page, "Write a very long list of colours, one per line.", 300)
        if where == "layers":
            show_tab(page, "layers")
        reply_done(page, n + 1)
        m = re.search(r"([\d.]+) tok/s", stats(page))
        assert m, stats(page)
        speeds[where].append(float(m.group(1)))
    hidden, shown = (statistics.median(speeds[k]) for k in ("hidden", "layers"))
    print(f"\nreply tok/s, Layers tab hidden {speeds['hidden']} vs open {speeds['layers']}: "
          f"median {shown:.1f} / {hidden:.1f} = {100 * shown / hidden:.0f} %")
    page.context.close()
