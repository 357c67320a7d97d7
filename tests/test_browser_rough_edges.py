"""Rough edges a newcomer hit (issue 52), in headless Chromium on the shared app: the chat
log's own clear icon forgets the conversation as the Clear button does; a token index typed
past the end of the Layers slider snaps to the last token, with no toast and no failing tick;
the Engine tab's latency table draws only its light row rules (Gradio's prose style gave its
rows a dark box)."""
import pytest

from test_browser import (browser, open_app, running, send, set_number,  # noqa: F401
                          show_tab, wait_js)
from test_browser_newcomer import reply_done
from ui_helpers import wait_until

pytestmark = pytest.mark.slow


def failed_requests(page) -> list[str]:
    """Every HTTP 4xx/5xx answer the page gets from now on (collected as they come)."""
    bad: list[str] = []
    page.on("response", lambda r: bad.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    return bad


def test_the_chat_logs_clear_icon_forgets_the_conversation(running, browser):
    page = open_app(browser, running.url)
    page.locator("#chat-history input").set_checked(True)
    send(page, "Copy: glass box", 8, ignore_eos=False)
    reply_done(page, 1)
    page.locator("#chat-log").hover()
    page.locator("#chat-log button[aria-label='Clear']").click()
    wait_js(page, "() => !document.querySelector('[data-testid=bot]')", what="an empty chat log")
    send(page, "Copy: cat", 8, ignore_eos=False)
    wait_until(lambda: page.locator("[data-testid=bot]").count() >= 1, timeout=90)
    wait_js(page, "() => !document.querySelector('#chat-send').disabled", what="reply to end")
    assert page.locator("[data-testid=bot]").count() == 1, "the cleared turns came back"
    rid = page.inner_text("#chat-stats").split(" · ")[0].strip()
    # the second prompt holds one user turn: the cleared ones were not sent again
    tr = running.llm.trace(rid)
    text = running.hub.decode(tr.prompt_token_ids)
    assert "glass box" not in text, text
    page.context.close()


def test_a_token_index_past_the_end_snaps_to_the_last_token(running, browser):
    page = open_app(browser, running.url)
    bad = failed_requests(page)
    send(page, "Copy: glass box", 8, ignore_eos=False)
    reply_done(page, 1)
    show_tab(page, "layers")
    wait_js(page, "() => document.querySelector('#layers-status').textContent"
                  ".includes('finished')", what="the finished reply in Layers")
    last = int(page.get_attribute("#layers-token input[type=range]", "max"))
    set_number(page, "layers-token", last + 40)
    wait_js(page, "(t) => +document.querySelector('#layers-token input[type=number]').value"
                  " === t", last, what=f"the number box snapped back to {last}")
    page.wait_for_timeout(2500)         # a few of the tab's ticks
    assert page.locator(".toast-body").count() == 0, page.locator(".toast-body").all_inner_texts()
    assert not bad, bad
    assert f"token **{last}**" in page.inner_text("#layers-status") or \
        f"token {last}" in page.inner_text("#layers-status")
    page.context.close()


def test_the_what_if_form_shows_steering_fields_only_for_steer(running, browser):
    page = open_app(browser, running.url)
    page.click("#iv-accordion button")                   # open the accordion
    page.wait_for_selector("#iv-kind")
    assert not page.is_visible("#iv-prompt-a")
    options = page.locator("#iv-kind label").all_inner_texts()
    assert any("mask experts" in o for o in options) == bool(running.llm.moe_layers), options
    page.locator("#iv-kind label", has_text="steer").click()
    page.wait_for_selector("#iv-prompt-a", state="visible")
    page.locator("#iv-kind label", has_text="ablate heads").click()
    page.wait_for_selector("#iv-prompt-a", state="hidden")
    page.context.close()


def test_cached_free_blocks_are_drawn_only_when_asked(running, browser):
    page = open_app(browser, running.url)
    send(page, "Copy: glass box", 8, ignore_eos=False)
    reply_done(page, 1)                 # its blocks stay cached but free
    show_tab(page, "kv")
    page.wait_for_selector("#kv-grid .kv-show-cached")
    root = "document.querySelector('#kv-grid .kv-map')"
    wait_js(page, f"() => {root}.dataset.showCached === '0'", what="cached blocks hidden")
    page.check("#kv-grid .kv-show-cached")
    wait_js(page, f"() => {root}.dataset.showCached === '1'", what="cached blocks shown")
    page.reload()                       # remembered per browser
    show_tab(page, "kv")
    wait_js(page, f"() => ({root} || {{dataset: {{}}}}).dataset.showCached === '1'",
            what="the choice kept after a reload")
    page.context.close()


def test_the_latency_table_has_no_dark_row_borders(running, browser):
    page = open_app(browser, running.url)
    send(page, "Copy: glass box", 8, ignore_eos=False)
    reply_done(page, 1)
    show_tab(page, "engine")
    page.wait_for_selector("#engine-latency table tr")
    borders = page.evaluate("""() => [...document.querySelectorAll('#engine-latency tr')]
      .map(r => getComputedStyle(r)).map(s => [s.borderTopWidth, s.borderLeftWidth,
                                               s.borderRightWidth])""")
    assert all(b == ["0px", "0px", "0px"] for b in borders), borders
    page.context.close()
