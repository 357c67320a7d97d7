"""Headless Chromium opens the Anatomy tab on the dense demo, on the MoE demo (switched to
under the running page) and on an engine with tensor_parallel_size=2 on the CPU: every plot
renders, typing text shows its ids, a block id shows its owner, the watched reply's token fills
the path with live numbers, a what-if TP degree redraws the rank table; no console errors.
Saves a screenshot of the token path and the KV block to a temporary folder (the README's
come from tools/screenshots.py)."""
import os
import re

import pytest

from test_browser import (MAX_SHOT_BYTES, SHOTS, headless_chromium, new_page, plot_rendered,
                          send, show_tab, skip_or_fail, wait_js)
from ui_helpers import free_port, require_engine, wait_until

pytestmark = pytest.mark.slow
PLOTS = (("anatomy-weights", "Weights:"), ("anatomy-regions", "regions of"),
         ("anatomy-tp-bytes", "What one rank holds"), ("anatomy-tp-map", "Tensor-parallel map"),
         ("anatomy-depth", "Depth vs width"))


class AnatomyApp:
    """The playground over its own engine (a demo checkpoint, optionally TP 2) on a free port."""

    def __init__(self, tp: int = 1):
        os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
        import app
        from engine import LLM
        kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=96, block_size=16,
                      tensor_parallel_size=tp)
        self.llm = LLM(str(app.DEMO_DENSE), **kwargs)
        self.demo = app.build_app(self.llm, choices=app.demo_choices(), llm_kwargs=kwargs)
        self.hub = self.demo.hub
        self.port = free_port()
        app.launch(self.demo, port=self.port, prevent_thread_lock=True)
        self.url = f"http://127.0.0.1:{self.port}/"

    def close(self):
        self.demo.close()
        self.hub.llm.shutdown()


@pytest.fixture(scope="module")
def browser():
    require_engine()
    import app
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        skip_or_fail("playwright is not installed (pip install playwright)")
    if not (app.DEMO_DENSE / "config.json").exists() or not (app.DEMO_MOE / "config.json").exists():
        pytest.skip("the demo checkpoints are missing")
    yield from headless_chromium()


def open_page(browser, url):
    page = new_page(browser)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("#chat-input textarea")
    return page, errors


SECTIONS = ["#anatomy-sec-1", "#anatomy-sec-2", "#anatomy-sec-3", "#anatomy-sec-4",
            "#anatomy-sec-5", "#anatomy-code-fold"]


def open_sections(page):
    """Unfold every section of the tab (they start folded, so the tab fits a screen or two)."""
    for sel in SECTIONS:
        wrap = page.locator(f"{sel} .label-wrap").first
        if "open" not in (wrap.get_attribute("class") or "").split():
            wrap.click()
        wait_js(page, "(s) => document.querySelector(s + ' .label-wrap').classList"
                      ".contains('open')", sel, f"{sel} to unfold")


def check_anatomy_renders(page, hub, moe: bool, tp: int):
    open_sections(page)
    for elem, title in PLOTS:
        plot_rendered(page, elem, title)
    llm = hub.llm
    code = page.inner_text("#anatomy-code")
    assert "runs here (CPU)" in code and "rms_norm_ref" in code
    assert ("fused_moe_cpu" in code) == moe
    assert page.locator("#anatomy-path .anat-layer").count() == llm.hf_config.num_hidden_layers
    assert ("MoE block" in page.inner_text("#anatomy-layer")) == moe
    assert f"TP {tp} (running)" in page.text_content("#anatomy-tp-bytes")
    assert page.locator("#anatomy-tp-table table tr").count() == tp + 1


def type_text_and_ids(page, llm):
    text = "the quick brown fox"
    page.fill("#anatomy-text textarea", text)
    want = [str(i) for i in llm.tokenizer.encode(text, add_special_tokens=False)]
    wait_js(page, "(want) => JSON.stringify([...document.querySelectorAll("
                  "'#anatomy-tokens .anat-tok')].map(e => e.dataset.id)) === JSON.stringify(want)",
            want, "the typed text's token ids")
    page.fill("#anatomy-ids textarea", " ".join(want))
    wait_js(page, "(t) => document.querySelector('#anatomy-decoded').textContent.includes(t)",
            text, "the ids decoded back to the text")


def check_live_and_block(page, hub, abort: bool = True) -> str:
    """While the session's reply streams beside a burst that oversubscribes the cache (so
    blocks stay owned for a while even on a fast CPU): its token's live numbers, and the owner
    of a block as the engine reports it."""
    from views.kv_cache import fire_burst
    show_tab(page, "chat")
    page.click("#chat-clear")        # a fresh conversation: the demo's context is 512 tokens
    send(page, "Write a very long list of colours, one per line.", 440)
    sess = wait_until(lambda: next((s for s in hub.sessions.values() if s.watched), None), 60)
    rid = sess.watched
    # 16 replies of up to 440 tokens need ~500 blocks of a 96-block cache: they take turns
    # (preemption), so requests own blocks for many seconds even on a fast CPU
    burst = fire_burst(hub, 16, max_tokens=440)
    table = wait_until(lambda: hub.snapshot(max_age=0).block_tables.get(burst[0]), 30)
    show_tab(page, "anatomy")
    box = page.locator("#anatomy-block input[type=number]")
    box.fill(str(table[-1]))         # its newest block
    box.press("Tab")
    seen: set[str] = set()           # owners the engine reported since the block was chosen

    def page_shows_an_owner():
        seen.update(*(b.owners for b in hub.snapshot(max_age=0).blocks
                      if b.block_id == table[-1]))
        text = page.text_content("#anatomy-block-info") or ""
        shown = re.search(r"block (\d+):.*owner requests: (.*?) ·", text)
        return (shown is not None and int(shown.group(1)) == table[-1]
                and bool(set(shown.group(2).split(", ")) & seen))
    wait_until(page_shows_an_owner, 60, 0.1)
    plot_rendered(page, "anatomy-regions", f"Block {table[-1]}:")
    wait_js(page, "(r) => document.querySelector('#anatomy-live-status').textContent"
                  ".includes(r)", rid, "the watched reply in the status")
    wait_js(page, "() => document.querySelector('#anatomy-path').textContent.includes('‖x‖')",
            what="live norms in the token path")
    if abort:
        abort_everything(hub)
    return rid


def abort_everything(hub):
    snap = hub.snapshot(max_age=0)
    for r in snap.running + snap.waiting:
        hub.llm.abort(r)


def screenshot_between(page, name: str, top_sel: str, bottom_sel: str):
    """A PNG of the page from one element's top to another's bottom (the whole tab is five
    screens: the README shows the token path and the KV block), quantised like the others."""
    import io

    from PIL import Image
    y = "(s) => { const r = document.querySelector(s).getBoundingClientRect();" \
        " return [r.top + window.scrollY, r.bottom + window.scrollY]; }"
    top, bottom = page.evaluate(y, top_sel)[0], page.evaluate(y, bottom_sel)[1]
    png = page.screenshot(full_page=True, clip=dict(x=0, y=max(top - 12, 0), width=1400,
                                                    height=bottom - top + 24))
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    assert path.stat().st_size < MAX_SHOT_BYTES, path.stat().st_size
    return path


def what_if_tp(page, tp: int):
    page.locator("#anatomy-tp label", has_text=str(tp)).first.click()
    wait_js(page, "(n) => document.querySelectorAll('#anatomy-tp-table table tr').length === n",
            tp + 1, f"{tp} rank rows")


def no_text_over_text(page):
    """Issue 52.5: the weights bar's callouts and their arrows cross no label or legend."""
    from test_browser_fit import FIT_JS
    page.wait_for_timeout(500)
    found = [p for p in page.evaluate(FIT_JS, ["anatomy"])
             if "overlaps" in p or "strikes through" in p or "drawn over" in p]
    assert not found, found


def test_anatomy_on_the_dense_demo_then_the_moe_demo(browser):
    running = AnatomyApp()
    try:
        page, errors = open_page(browser, running.url)
        show_tab(page, "anatomy")
        check_anatomy_renders(page, running.hub, moe=False, tp=1)
        no_text_over_text(page)
        type_text_and_ids(page, running.llm)
        what_if_tp(page, 4)
        assert "KV heads replicated" in page.inner_text("#anatomy-tp-table")   # 2 KV heads
        check_live_and_block(page, running.hub)
        # another visitor is mid-reply when the engine is switched under both pages
        other, _ = open_page(browser, running.url)
        send(other, "Write a very long list of colours, one per line.", 400)
        wait_until(lambda: other.locator("[data-testid=bot]").count() > 0, timeout=60)
        # switch the engine under the open page: the tab redraws for the MoE demo
        moe = next(k for k in running.hub.choices if "moe" in k.lower())
        running.hub.switch(moe)
        # every page now names the model it talks to, and the cut reply says why it stopped
        for pg in (page, other):
            wait_js(pg, "() => document.querySelector('#model-line').textContent"
                        ".includes('moe')", what="the model line naming the MoE demo")
            wait_js(pg, "(v) => document.querySelector('#model-switch input').value == v", moe,
                    what="the selector showing the MoE demo")
        wait_js(other, "() => [...document.querySelectorAll('[data-testid=bot]')].some("
                       "e => e.textContent.includes('the model was switched'))",
                what="the cut reply saying the model was switched")
        other.context.close()
        wait_js(page, "() => document.querySelector('#anatomy-layer').textContent"
                      ".includes('MoE block')", what="the MoE block after the switch")
        check_anatomy_renders(page, running.hub, moe=True, tp=1)
        no_text_over_text(page)
        check_live_and_block(page, running.hub, abort=False)
        assert "read per token" in page.text_content("#anatomy-weights")
        screenshot_between(page, "anatomy", "#anatomy-live-status", "#anatomy-block-info")
        abort_everything(running.hub)
        assert not errors, errors
        page.context.close()
    finally:
        running.close()


def test_anatomy_with_tensor_parallel_2_on_the_cpu(browser):
    running = AnatomyApp(tp=2)
    procs = list(getattr(running.llm.runner, "procs", []))
    try:
        page, errors = open_page(browser, running.url)
        show_tab(page, "anatomy")
        check_anatomy_renders(page, running.hub, moe=False, tp=2)
        assert "rank 0's" in page.inner_text("#anatomy-kv-plane")
        check_live_and_block(page, running.hub)
        what_if_tp(page, 1)
        assert not errors, errors
        page.context.close()
    finally:
        running.close()
    assert not any(p.is_alive() for p in procs), "a TP worker outlived shutdown"
