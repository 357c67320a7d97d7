"""The README's screenshots of the playground, and a console check of every tab.

    python tools/screenshots.py            # the dense demo -> assets/screenshots/*.png
    python tools/screenshots.py --moe      # the MoE demo instead (the README shows the dense
                                           # one: --out elsewhere to look without replacing)
    python tools/screenshots.py --check    # every tab at 1440x900 and 1024x768 on both demos:
                                           # prints console errors and failed requests, exit 1

The app runs in this process on a free localhost port, with the engine settings `python app.py`
uses (so the pictures show what a user sees), and headless Chromium drives it through Playwright.
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "assets" / "screenshots"
SHOT_SIZE = (1440, 900)
SIZES = [(1440, 900), (1024, 768)]
MAX_BYTES = 250_000            # README images stay small: a clone downloads them all
# the README's file name, the tab's button, and what is drawn once the tab shows its data
TABS = [("chat", "chat", "#chat-stats"), ("kv_cache", "kv", "#kv-grid canvas"),
        ("layers", "layers", "#layers-norms canvas"),
        ("engine", "engine", "#engine-timeline :is(canvas, .js-plotly-plot)"),
        ("anatomy", "anatomy", "#anatomy-sec-1")]
# a trained task with a reply of several tokens (README, "Demo checkpoints"): the lens, the
# heads and the timeline have columns to show, and the answer is checkable at a glance
MESSAGE = "Sort: 42 7 19 3"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update"]


def start_app(model: Path):
    """(demo, url): the playground over `model`, built as app.main builds it (both demos in the
    model selector, the CLI's engine defaults), launched without blocking this thread."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import app
    from api.cli import engine_kwargs
    from engine import LLM
    from engine.parallel import free_port
    args = app.parse_args(["--model", str(model)])
    path, choices = app.switch_choices(args.model, args.no_model_switch)
    kwargs = dict(engine_kwargs(args), record_expert_load=True)
    demo = app.build_app(LLM(path, **kwargs), choices=choices, llm_kwargs=kwargs)
    port = free_port()
    app.launch(demo, port=port, prevent_thread_lock=True)
    return demo, f"http://127.0.0.1:{port}/"


def stop_app(demo) -> None:
    demo.close()
    demo.hub.shutdown()


def chromium(p):
    """Playwright's own Chromium when installed, else the system's (as tests/test_browser.py)."""
    path = None if os.path.exists(p.chromium.executable_path) else (
        shutil.which("chromium") or shutil.which("chromium-browser"))
    return p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)


def open_page(browser, url: str, size):
    """A page that has seen the guided tour already (views/tour.js): its card would cover
    the tabs."""
    ctx = browser.new_context(viewport={"width": size[0], "height": size[1]})
    ctx.add_init_script("localStorage.setItem('gb-tour-done', '1')")
    page = ctx.new_page()
    page.set_default_timeout(90_000)   # 2 shared cores: the first render of a tab can be slow
    return page


def chat(page, url: str, message: str, max_tokens: int | None = None) -> None:
    """Load the page and send `message`; greedy (the demo's default). `max_tokens` with EOS
    ignored keeps a reply streaming while the tabs are visited (the check)."""
    page.goto(url)
    page.wait_for_selector("#chat-input textarea")
    if max_tokens:
        box = page.locator("#chat-max-tokens input[type=number]")
        box.fill(str(max_tokens))
        box.press("Tab")
        page.locator("#chat-ignore-eos input").set_checked(True)
    page.fill("#chat-input textarea", message)
    page.click("#chat-send")
    page.wait_for_selector("[data-testid=bot]")


def reply_done(page) -> None:
    page.wait_for_function("() => !document.querySelector('#chat-send').disabled &&"
                           " document.querySelector('#chat-stats').textContent.includes('TTFT')")


def show_tab(page, button: str, ready: str) -> None:
    """Open a tab and wait for its data and its "What this shows" line, then for a few live
    updates (the first draw can precede the first tick's data)."""
    page.click(f"#tab-{button}-button")
    page.wait_for_selector(ready, state="visible")
    if button != "chat":
        page.wait_for_function("(b) => [...document.querySelectorAll('#tab-' + b + ' *')]"
                               ".some(e => e.checkVisibility() && e.children.length === 0 &&"
                               " e.textContent.includes('What this shows'))", arg=button)
    page.wait_for_timeout(2500)


def save_png(png: bytes, path: Path) -> int:
    """256 colours (the UI is flat colour: no visible loss), optimised; returns the bytes."""
    from PIL import Image
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img.quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path.stat().st_size


def kv_burst(page, hub) -> None:
    """The KV tab's own button: six requests sharing a system prompt, so the map shows owned
    and shared blocks and the tables their shared prefix; then a click on a shared block fills
    the drilldown with its K numbers (the picture is taken while the burst decodes)."""
    box = page.locator("#kv-burst-tokens input[type=number]")
    box.fill("384")                  # long enough to still decode when the picture is taken
    box.press("Tab")
    page.click("#kv-burst")
    page.wait_for_function("() => +(document.querySelector('#kv-grid .kv-map') || {dataset: {}})"
                           ".dataset.shared > 0 && document.querySelectorAll("
                           "'#kv-tables .kv-trow').length >= 2")
    shared = next(b.block_id for b in hub.snapshot(max_age=0).blocks if b.ref_count > 1)
    xy = page.evaluate("(id) => document.querySelector('#kv-grid .kv-map').kvCellCenter(id)",
                       shared)
    page.mouse.click(xy["x"], xy["y"])
    page.wait_for_function("(id) => [...document.querySelectorAll('#kv-block-plot *')]"
                           ".some(e => e.textContent.includes('of block ' + id))", arg=shared)


def anatomy_path(page, hub) -> None:
    """Section 2 unfolded: the token path with the watched reply's live numbers."""
    page.click("#anatomy-sec-2 .label-wrap")
    # (a folded section's contents are rendered when it first opens: null until then)
    page.wait_for_function("() => (document.querySelector('#anatomy-path') || {})"
                           ".textContent?.includes('‖x‖')")


SETUP = {"kv": kv_burst, "anatomy": anatomy_path}


def screenshots(model: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    from views.demo_tasks import DEMO_EXAMPLES
    demo, url = start_app(model)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as p:
            browser = chromium(p)
            page = open_page(browser, url, SHOT_SIZE)
            page.goto(url)
            page.click(f"#chat-example-{DEMO_EXAMPLES.index(MESSAGE)}")   # as a user would
            reply_done(page)
            for name, button, ready in TABS:
                show_tab(page, button, ready)
                if button in SETUP:
                    SETUP[button](page, demo.hub)
                    page.wait_for_timeout(1000)   # a live update or two after the click
                page.mouse.move(0, 0)            # no hover card over the picture
                # the whole tab, as a reader scrolls it
                size = save_png(page.screenshot(full_page=True), out / f"{name}.png")
                print(f"{out / name}.png  {size / 1024:.0f} KiB"
                      + ("  (over the 250 KB aim)" if size > MAX_BYTES else ""))
            browser.close()
    finally:
        stop_app(demo)


def gradio_stream_closed(request) -> bool:
    """Gradio's client aborts its own event stream (GET /gradio_api/queue/data) when the server
    says `close_stream` (no job of the page pending): Chromium reports net::ERR_ABORTED, which
    is the normal end of a stream, not a fault."""
    return ("/gradio_api/queue/data" in request.url
            and (request.failure or "").startswith("net::ERR_ABORTED"))


def watch(page, label, problems: list[str]) -> dict:
    """Record the page's console errors, uncaught exceptions, failed requests and HTTP errors
    as "label where: what" lines; returns the dict whose "where" names the step, and whose
    "on" turns recording off (closing a page cancels its open streams: not a fault)."""
    st = {"where": "load", "on": True}

    def add(what: str) -> None:
        if st["on"]:
            problems.append(f"{label} {st['where']}: {what}")
    page.on("console", lambda m: add(f"console {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: add(f"exception {e}"))
    page.on("requestfailed", lambda r: None if gradio_stream_closed(r) else add(
        f"failed {r.method} {r.url} ({r.failure})"))
    page.on("response", lambda r: add(f"HTTP {r.status} {r.request.method} {r.url}")
            if r.status >= 400 else None)
    return st


def check(models: list[Path]) -> int:
    """Every tab of every demo at both sizes, while a reply streams and again after it;
    prints each problem and returns how many."""
    from playwright.sync_api import sync_playwright
    problems: list[str] = []
    for model in models:
        demo, url = start_app(model)
        try:
            with sync_playwright() as p:
                browser = chromium(p)
                for size in SIZES:
                    page = open_page(browser, url, size)
                    st = watch(page, f"{model.name} {size[0]}x{size[1]}", problems)
                    chat(page, url, "Tell me about lists.", max_tokens=300)
                    for when in ("streaming", "done"):
                        for name, button, ready in TABS:
                            st["where"] = f"{name} ({when})"
                            show_tab(page, button, ready)
                        if when == "streaming":
                            st["where"] = "chat (waiting for the reply)"
                            page.click("#tab-chat-button")
                            reply_done(page)
                    st["on"] = False
                    page.context.close()
                    print(f"checked {model.name} at {size[0]}x{size[1]}", flush=True)
                browser.close()
        finally:
            stop_app(demo)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s)")
    return len(problems)


def main() -> int:
    import app
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe", action="store_true", help="the MoE demo instead of the dense one")
    ap.add_argument("--check", action="store_true",
                    help="no pictures: every tab, both sizes, both demos; exit 1 on any error")
    ap.add_argument("--out", type=Path, default=OUT, help=f"folder for the PNGs ({OUT})")
    args = ap.parse_args()
    if args.check:
        return 1 if check([app.DEMO_DENSE, app.DEMO_MOE]) else 0
    screenshots(app.DEMO_MOE if args.moe else app.DEMO_DENSE, args.out)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown: Triton's bindings print a page of nanobind "leaked"
    # warnings there, after the report (the app was already stopped)
    os._exit(code)
