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


@pytest.fixture(scope="module")
def moe_app():
    """The playground over the MoE demo, on its own port (the shared app serves the dense one)."""
    import os

    import app
    from engine import LLM
    from ui_helpers import free_port
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=160, block_size=16)
    from ui_helpers import ROOT
    llm = LLM(str(ROOT / "assets" / "demo-qwen3-moe"), **kwargs)
    demo = app.build_app(llm, llm_kwargs=kwargs)
    port = free_port()
    app.launch(demo, port=port, prevent_thread_lock=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()
    demo.hub.shutdown()


def test_clicking_an_expert_in_the_routing_chart_reruns_without_it(moe_app, browser):  # noqa: F811
    page = open_app(browser, moe_app)
    send(page, "What is 47+38?", 16, ignore_eos=False)
    wait_until(lambda: "85" in bot_text(page), timeout=60)
    show_tab(page, "layers")
    page.click("#layers-follow input")
    wait_js(page, "() => { const c = document.querySelector('#layers-routing .gb-chart');"
                  " return !!(c && c.cellCenter && c.cellCenter(0, 0)); }",
            what="the routing chart")
    page.locator("#layers-routing canvas").scroll_into_view_if_needed()
    time.sleep(0.5)
    from test_browser_fit import FIT_JS          # the MoE charts draw no label over another
    drawn_over = [p for p in page.evaluate(FIT_JS, ["layers"]) if "drawn over" in p]
    assert not drawn_over, drawn_over
    xy = page.evaluate("() => document.querySelector('#layers-routing .gb-chart')"
                       ".cellCenter(3, 1)")                  # MoE layer 3, expert 1
    page.mouse.click(xy["x"], xy["y"])
    wait_js(page, "() => document.querySelector('#iv-expert-from-layers')?.innerText"
                  "?.includes('layer 3 expert 1')", what="the armed expert button")
    page.click("#iv-expert-from-layers")
    wait_js(page, "() => (document.querySelector('#iv-result') || {}).innerText?.includes("
                  "'They part')", what="the comparison in the chat tab")
    text = page.inner_text("#iv-result")
    assert "mask experts [1] at layer 3" in text and "47" in text, text
    page.context.close()
