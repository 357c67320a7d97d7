"""The playground teaches itself (issue 52), in headless Chromium on the shared app: a first
visit gets a short tour that sends a demo example and points at its KV blocks, its layers and
one intervention found on the demo, which it then tries; finished or skipped, it stays gone in
that browser. The "Try this" list's buttons fill the What-if form and compare."""
import pytest

from test_browser import browser, quiet_context, running, wait_js  # noqa: F401
from ui_helpers import wait_until

pytestmark = pytest.mark.slow


def fresh_page(browser, url):
    """A browser that never saw the tour."""
    page = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#chat-input textarea")
    return page


def found(running) -> list[dict]:
    """The effects the search found on the shared app's checkpoint (waits for the search)."""
    from views.try_this import found_store
    store = found_store(running.hub)                    # starts the search if no page did
    return wait_until(lambda: store.get(running.llm.model_path), timeout=180)


def marked(page, sel):
    wait_js(page, "(s) => { const e = document.querySelector(s);"
                  " return !!e && e.classList.contains('gb-tour-target'); }", sel,
            what=f"the tour pointing at {sel}")


def test_the_tour_sends_an_example_shows_its_blocks_layers_and_tries_an_effect(running,
                                                                              browser):
    if not running.hub.is_demo():
        pytest.skip("no bundled demo checkpoint")
    effects = found(running)
    assert isinstance(effects, list) and effects, effects
    page = fresh_page(browser, running.url)
    page.wait_for_selector("#gb-tour-card")
    assert "Copy: glass box" in page.inner_text("#gb-tour-card")
    marked(page, "#chat-example-1")
    page.click(".gb-tour-next")                         # sends the example
    wait_until(lambda: page.locator("[data-testid=bot]").count() == 1, timeout=60)
    marked(page, "#kv-grid")
    assert page.get_attribute("#tab-kv-button", "aria-selected") == "true"
    page.click(".gb-tour-next")
    marked(page, "#layers-lens")
    page.click(".gb-tour-next")
    marked(page, "#iv-try")
    page.wait_for_selector("#iv-try-0", state="visible")
    page.click(".gb-tour-next")                         # "Done": tries the first effect
    wait_js(page, "() => (document.querySelector('#iv-result') || {}).innerText?.includes("
                  "'Intervention')", what="the tried effect's comparison")
    assert effects[0]["after"] in page.inner_text("#iv-result")
    assert page.locator("#gb-tour-card").count() == 0
    page.reload()
    page.wait_for_selector("#chat-input textarea")
    page.wait_for_timeout(1000)
    assert page.locator("#gb-tour-card").count() == 0, "the tour came back after it was done"
    page.context.close()


def test_skipping_the_tour_ends_it_for_good_until_asked_again(running, browser):
    page = fresh_page(browser, running.url)
    page.click(".gb-tour-skip")
    assert page.locator("#gb-tour-card").count() == 0
    page.reload()
    page.wait_for_selector("#chat-input textarea")
    page.wait_for_timeout(1000)
    assert page.locator("#gb-tour-card").count() == 0
    page.click("#tour-start")                           # the header's "Guided tour"
    page.wait_for_selector("#gb-tour-card")
    page.context.close()


def test_a_try_this_button_fills_the_form_and_shows_its_effect(running, browser):
    if not running.hub.is_demo():
        pytest.skip("no bundled demo checkpoint")
    effects = found(running)
    page = quiet_context(browser).new_page()
    page.set_default_timeout(60_000)
    page.goto(running.url)
    page.click("#iv-accordion > button")
    last = len(effects) - 1                              # the steer, when found: fills most
    page.wait_for_selector(f"#iv-try-{last}", state="visible")
    page.click(f"#iv-try-{last}")
    e = effects[last]
    wait_js(page, "() => (document.querySelector('#iv-result') || {}).innerText?.includes("
                  "'Intervention')", what="the comparison")
    assert e["after"] in page.inner_text("#iv-result")
    assert page.input_value("#chat-input textarea") == e["message"]
    if e["kind"] == "steer":
        assert page.input_value("#iv-prompt-a textarea, #iv-prompt-a input") == e["prompt_a"]
    page.context.close()
