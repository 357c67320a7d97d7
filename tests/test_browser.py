"""Headless Chromium clicks through the playground: chat streams, every tab's plots render,
two browser sessions batch together in the block map, Stop frees their blocks. Takes the
README's screenshots: into a temporary folder, or into assets/screenshots/ when
GLASSBOX_SCREENSHOTS=1 (a test run must not rewrite tracked files)."""
import io
import os
import tempfile
from pathlib import Path

import pytest

from ui_helpers import ROOT, require_engine, shared_app, wait_until  # noqa: I001

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHOTS = (ROOT / "assets" / "screenshots" if os.environ.get("GLASSBOX_SCREENSHOTS") == "1"
         else Path(tempfile.gettempdir()) / "glassbox-screenshots")
MAX_SHOT_BYTES = 300_000


@pytest.fixture(scope="module")
def running():
    require_engine()
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed")
    pytest.importorskip("playwright.sync_api")
    return shared_app()


@pytest.fixture(scope="module")
def browser(running):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_app(browser, url):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#chat-input textarea")
    return page


def set_number(page, elem_id, value):
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Tab")


def send(page, message, max_tokens, temperature=0.0, ignore_eos=True):
    """Send a chat message; ignore_eos keeps the small demo model talking long enough to watch."""
    set_number(page, "chat-max-tokens", max_tokens)
    set_number(page, "chat-temperature", temperature)
    page.locator("#chat-ignore-eos input").set_checked(ignore_eos)
    page.fill("#chat-input textarea", message)
    page.click("#chat-send")


def bot_text(page) -> str:
    msgs = page.locator("[data-testid=bot]")
    return msgs.last.inner_text() if msgs.count() else ""


def show_tab(page, tab):
    page.click(f"#tab-{tab}-button")


def wait_js(page, expr, arg=None, what=""):
    """page.wait_for_function with a failure message that says what never happened."""
    from playwright.sync_api import TimeoutError as PWTimeout
    try:
        page.wait_for_function(expr, arg=arg)
    except PWTimeout:
        raise AssertionError(f"timed out waiting for {what or expr}") from None


def plot_rendered(page, elem_id, title_part):
    """The gr.Plot with this elem_id drew a plotly figure whose title contains `title_part`."""
    wait_js(page, "([sel, t]) => [...document.querySelectorAll(sel)]"
                  ".some(e => e.textContent.includes(t))",
            [f"#{elem_id} .js-plotly-plot .gtitle", title_part],
            f"plot #{elem_id} titled {title_part!r}")


def screenshot(page, name):
    """Full-page PNG quantised to 256 colours, so README images stay small."""
    from PIL import Image
    img = Image.open(io.BytesIO(page.screenshot(full_page=True))).convert("RGB")
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    img.quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    if path.stat().st_size > MAX_SHOT_BYTES:     # fall back to JPEG for a busy page
        path.unlink()
        path = SHOTS / f"{name}.jpg"
        img.save(path, quality=80, optimize=True)
    assert path.stat().st_size < MAX_SHOT_BYTES
    return path


def abort_everything(running):
    snap = running.hub.snapshot(max_age=0)
    for rid in snap.running + snap.waiting:
        running.llm.abort(rid)


def test_tour_chat_streams_and_every_tab_renders(running, browser):
    page = open_app(browser, running.url)
    send(page, "Tell me a story about a robot who paints.", 160)
    seen = set()
    def streamed():   # several different partial replies: it streamed
        seen.add(bot_text(page))
        return len(seen - {""}) >= 3
    try:
        wait_until(streamed, timeout=60, interval=0.05)
    except AssertionError:
        raise AssertionError(f"saw only {seen!r}") from None
    wait_js(page, "() => document.querySelector('#chat-stats').textContent.includes('TTFT')",
            what="per-reply stats")
    assert bot_text(page).strip()
    screenshot(page, "chat")

    # the KV tab while a reply and a shared-prefix burst run
    send(page, "And now a long one about caches.", 400)
    show_tab(page, "kv")
    plot_rendered(page, "kv-usage", "KV usage")
    page.click("#kv-drill-show")
    plot_rendered(page, "kv-block-plot", "of block 0")
    set_number(page, "kv-burst-tokens", 384)
    page.click("#kv-burst")
    page.wait_for_selector("#kv-grid .kv-grid .kv-cell.kv-shared")
    wait_js(page, "() => document.querySelectorAll('#kv-tables .kv-trow').length >= 2",
            what="two block tables")
    assert page.locator("#kv-grid .kv-grid .kv-cell").count() == running.llm.num_kv_blocks
    page.locator("#kv-grid .kv-grid .kv-cell.kv-shared").first.hover()
    screenshot(page, "kv_cache")

    show_tab(page, "layers")
    for elem, title in (("layers-norms", "Residual norms"), ("layers-lens", "Logit lens"),
                        ("layers-heads", "attention of token"), ("layers-row", "head")):
        plot_rendered(page, elem, title)
    assert "Watching" in page.inner_text("#layers-status")
    screenshot(page, "layers")

    show_tab(page, "engine")
    for elem, title in (("engine-timeline", "Batch timeline"), ("engine-steptime", "Step time"),
                        ("engine-graphs", "CUDA graphs"), ("engine-tp", "Tensor-parallel")):
        plot_rendered(page, elem, title)
    screenshot(page, "engine")

    show_tab(page, "chat")                         # an empty message: a clear note, no crash
    page.fill("#chat-input textarea", "")
    page.click("#chat-send")
    wait_js(page, "() => document.querySelector('#chat-stats').textContent.includes('empty')",
            what="the empty-message warning")
    abort_everything(running)
    page.context.close()


def test_two_browser_sessions_share_the_block_map_and_stop_frees_blocks(running, browser):
    a, b = open_app(browser, running.url), open_app(browser, running.url)
    for page in (a, b):
        send(page, "Write a very long list of colours, one per line.", 900)
    show_tab(a, "kv")

    def owners(where="#kv-tables .kv-trow", attr="data-request"):
        found = a.evaluate(
            "([sel, attr]) => [...document.querySelectorAll(sel)]"
            ".flatMap(e => (e.getAttribute(attr) || '').split(','))", [where, attr])
        return {r for r in found if r.startswith("chat-")}
    chats = wait_until(lambda: len(owners()) >= 2 and owners(), timeout=60)
    grid_owners = owners("#kv-grid .kv-cell[data-owners]", "data-owners")
    assert chats <= grid_owners
    snap = running.hub.snapshot(max_age=0)
    assert any({e.request_id for e in s.entries} >= chats for s in snap.steps[-20:])

    for page in (a, b):
        show_tab(page, "chat")
        page.click("#chat-stop")
    show_tab(a, "kv")
    wait_until(lambda: not owners(), timeout=30)           # the grid shows them freed ...
    snap = running.hub.snapshot(max_age=0)
    assert not chats & set(snap.block_tables)              # ... and so does the engine
    a.context.close()
    b.context.close()


def test_closing_the_tab_aborts_its_reply(running, browser):
    page = open_app(browser, running.url)
    send(page, "Write a very long list of animals, one per line.", 900)
    wait_until(lambda: len(bot_text(page)) > 5, timeout=60)
    rid = next(r for r, s in running.hub.sessions.items() if s.active)
    active = set(running.hub.sessions[rid].active)
    page.context.close()
    wait_until(lambda: not active & set(running.hub.snapshot(max_age=0).block_tables),
               timeout=30)
