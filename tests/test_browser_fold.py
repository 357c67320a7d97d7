"""The chat above the fold (issue 52.6), in headless Chromium on the shared app: at 1440×900 the
message box, its buttons, the reply's stats, the context and demo notes and the "What if"
header are all on the first screen after a reply; at 1024×768 every example button is whole on
it, and the message box shows its whole placeholder."""
import pytest

from test_browser import browser, quiet_context, running, send  # noqa: F401
from test_browser_newcomer import reply_done

pytestmark = pytest.mark.slow

BOTTOM_JS = """(sel) => { const e = document.querySelector(sel); if (!e) return null;
  const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }"""
# the placeholder's width in the text box's own font, against the room inside the box
PLACEHOLDER_JS = """() => { const t = document.querySelector('#chat-input textarea');
  const st = getComputedStyle(t), c = document.createElement('canvas').getContext('2d');
  c.font = `${st.fontWeight} ${st.fontSize} ${st.fontFamily}`;
  const room = t.clientWidth - parseFloat(st.paddingLeft) - parseFloat(st.paddingRight);
  return [c.measureText(t.placeholder).width, room]; }"""


def open_at(browser, url, w, h):
    page = quiet_context(browser, w, h).new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#chat-input textarea")
    return page


def test_chat_controls_stats_and_notes_above_the_fold_at_1440x900(running, browser):
    page = open_at(browser, running.url, 1440, 900)
    send(page, "hi", 8, ignore_eos=False)     # a free prompt: stats, and on a demo its note
    reply_done(page, 1)
    page.evaluate("() => window.scrollTo(0, 0)")
    below = {}
    for sel in ("#chat-input", "#chat-send", "#chat-stop", "#chat-clear", "#chat-stats",
                "#chat-context", "#chat-note", "#iv-accordion > button", "#chat-system"):
        box = page.evaluate(BOTTOM_JS, sel)
        assert box is not None, sel
        if box[3] > 900:
            below[sel] = round(box[3])
    assert not below, f"below the fold (900 px): {below}"
    page.context.close()


def test_example_buttons_and_placeholder_whole_at_1024x768(running, browser):
    if not running.hub.is_demo():
        pytest.skip("no bundled demo checkpoint")
    page = open_at(browser, running.url, 1024, 768)
    cut = {}
    for i in range(page.locator("#chat-examples button").count()):
        box = page.evaluate(BOTTOM_JS, f"#chat-example-{i}")
        if box[3] > 768 or box[2] > 1024:
            cut[i] = [round(v) for v in box]
    assert not cut, f"example buttons off the first screen: {cut}"
    width, room = page.evaluate(PLACEHOLDER_JS)
    assert width <= room, f"the placeholder is {width:.0f} px in a {room:.0f} px box"
    page.context.close()


def test_the_open_what_if_form_and_its_list_fit_at_1024x768(running, browser):
    if not running.hub.is_demo():
        pytest.skip("no bundled demo checkpoint")
    from test_browser_fit import FIT_JS
    from test_browser_tour import found
    found(running)
    page = open_at(browser, running.url, 1024, 768)
    page.click("#iv-accordion > button")
    page.wait_for_selector("#iv-try-0", state="visible")
    page.locator("#iv-kind label", has_text="steer").click()      # the widest form
    page.wait_for_selector("#iv-prompt-a", state="visible")
    problems = page.evaluate(FIT_JS, ["chat"])
    assert not problems, problems
    page.context.close()
