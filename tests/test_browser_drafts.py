"""Speculative decoding you can watch, in headless Chromium on the shared app (dense demo): the
chat's *speculate* turns n-gram drafts on for the page's requests, the reply streams with its
accepted drafts, rejected (ghosted) drafts and the model's token in their place marked, the
legend shows, and the Layers tab opens a rejection's verify step (the target's guesses beside
the n-gram note) and scrubs to the query that chose; no console errors on the way."""
import pytest

from test_browser import browser, open_app, running, send, show_tab, wait_js  # noqa: F401
from test_browser_newcomer import reply_done
from views import drafts as D

pytestmark = pytest.mark.slow
# the demo copies its input: n-gram lookup drafts from the prompt; after "red" the prompt goes
# on with both " fox" and " dog", so some drafts are kept and one is rejected (README: demo)
PROMPT = "Copy: red fox red fox red dog"
SHOT = "/tmp/specview_chat.png"
LAYERS_SHOT = "/tmp/specview_layers.png"


def test_speculation_marks_the_reply_and_layers_opens_a_rejection(running, browser):
    if not running.hub.is_demo():
        pytest.skip("needs the bundled demo checkpoint")
    page = open_app(browser, running.url)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    assert not page.is_visible("#chat-drafts-help")
    page.locator("#chat-speculate input").set_checked(True)
    page.wait_for_selector("#chat-drafts-help", state="visible")
    assert "What this shows" in page.inner_text("#chat-drafts-help")
    send(page, PROMPT, 24, ignore_eos=False)
    reply_done(page, 1)
    bot = page.locator("[data-testid=bot]").last
    accepted = bot.locator(f".{D.ACCEPTED}").all_inner_texts()
    rejected = bot.locator(f".{D.REJECTED}").all_inner_texts()
    chosen = bot.locator(f".{D.CHOSEN}").all_inner_texts()
    assert accepted and rejected and chosen, (accepted, rejected, chosen)
    # the ghosts are not the reply: its text without them is the plain reply
    clean = page.evaluate("""() => { const m = [...document.querySelectorAll(
        '[data-testid=bot]')].pop().cloneNode(true);
        m.querySelectorAll('.gb-draft-no').forEach(e => e.remove());
        return m.innerText.trim(); }""")
    assert clean == "red fox red fox red dog", clean
    assert "drafted tokens accepted" in page.inner_text("#chat-stats")
    page.locator("#chat-log").screenshot(path=SHOT)

    show_tab(page, "layers")
    page.wait_for_selector("#layers-rejections", state="visible")
    view = "#layers-rejection-view"
    wait_js(page, f"() => !!document.querySelector('{view} .gb-rej')",
            what="a rejection's verify view")
    assert D.NGRAM_NOTE in page.inner_text(view)
    assert page.locator(f"{view} #gb-rej-target .{D.CHOSEN}").count() >= 1
    assert page.locator(f"{view} #gb-rej-target .{D.REJECTED}").count() >= 1
    # pick it from the list: the slider goes to the query that chose in its place
    page.click("#layers-rejection input")
    option = page.locator("ul[role=listbox] li").first
    label = option.inner_text()
    option.click()
    position = int(label.split(":")[0].split()[-1])
    wait_js(page, "(t) => +document.querySelector('#layers-token input[type=number]').value"
                  " === t", position - 1, what=f"the slider at token {position - 1}")
    wait_js(page, f"(p) => (document.querySelector('{view} .gb-rej') || {{}}).dataset"
                  "?.position == p", position, what=f"the view of token {position}")
    assert not page.locator("#layers-follow input").is_checked()
    page.locator("#layers-rejections").screenshot(path=LAYERS_SHOT)
    page.wait_for_timeout(1000)
    assert not errors, errors
    page.context.close()
