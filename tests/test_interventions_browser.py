"""Headless Chromium: from the Layers tab, "re-run without this head" opens the Chat tab's What-if
accordion and compares the untouched and the intervened reply."""
import time

import pytest

from test_browser import (abort_everything, browser, open_app, running, screenshot,  # noqa: F401
                          send, show_tab, wait_js, bot_text)
from ui_helpers import wait_until

pytestmark = pytest.mark.slow


def test_rerun_without_the_chosen_head_compares_in_chat(running, browser):  # noqa: F811
    page = open_app(browser, running.url)
    send(page, "Copy: glass box", 24, ignore_eos=False)
    wait_until(lambda: "glass box" in bot_text(page), timeout=60)
    show_tab(page, "layers")
    page.click("#layers-follow input")
    time.sleep(1.0)                       # the pickers hold the watched reply's layer and head
    layer = page.input_value("#layers-layer input")
    head = page.input_value("#layers-head input")
    page.click("#iv-from-layers")
    wait_js(page, "() => (document.querySelector('#iv-result') || {}).innerText?.includes("
                  "'They part') || (document.querySelector('#iv-result') || {}).innerText"
                  "?.includes('Same tokens')", what="the comparison in the chat tab")
    text = page.inner_text("#iv-result")
    assert f"ablate heads [{head}] at layer {layer}" in text, text
    assert page.is_visible("#iv-result"), "the Chat tab should be shown"
    wait_js(page, "() => !!document.querySelector('#iv-plot .js-plotly-plot')",
            what="the overlaid norms / lens figure")
    screenshot(page, "interventions")
    abort_everything(running)
    page.context.close()
