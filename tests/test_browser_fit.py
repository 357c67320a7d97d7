"""Nothing clipped (issue 28): every tab at 1440×900 and at 1024×768, while a reply streams,
in headless Chromium. The page never scrolls sideways; no box's content is wider than the box
(cut off, or hidden behind a sideways scrollbar) and no text is wider than its box; nothing
sticks out of the window; no plotly label runs past its figure or covers another, and no callout's
arrow strikes through a label; no canvas chart shortened a label to fit or drew one over another. Screenshots of every tab at both sizes go to the screenshot
folder (tests/test_browser.py SHOTS) to look at."""
import pytest

from test_browser import (ReplyDriver, browser, quiet_context, running, screenshot,  # noqa: F401
                          send, show_tab)
from ui_helpers import wait_until

pytestmark = pytest.mark.slow
SIZES = [(1440, 900), (1024, 768)]
TABS = ["chat", "kv", "layers", "engine", "anatomy"]
# per tab: an element that is drawn once the tab shows its data
READY = {"chat": "#chat-log", "kv": "#kv-grid canvas", "layers": "#layers-norms canvas",
         "engine": "#engine-timeline :is(canvas, .js-plotly-plot)", "anatomy": "#anatomy-sec-1"}

# What is wrong on the page, as a list of "where: what" lines. A box "clips" when its
# content is wider than it (scrollWidth > clientWidth) and it hides or scrolls that overflow;
# form fields are left out (a long value in a text box scrolls inside it by design).
FIT_JS = """([tab]) => {
  const vw = document.documentElement.clientWidth, out = [];
  // an element by its elem_id, or by tag and class inside the nearest elem_id (Gradio's own
  // ids, "component-12" and "html-…", say nothing)
  const named = e => { for (let a = e; a; a = a.parentElement)
    if (a.id && !/^(component-|html-)/.test(a.id)) return a; return null; };
  const name = e => { const a = named(e); if (a === e) return '#' + e.id;
    const cls = typeof e.className === 'string' && e.className.trim() ?
      '.' + e.className.trim().split(/\\s+/).slice(0, 2).join('.') : '';
    return e.tagName.toLowerCase() + cls + (a ? ' in #' + a.id : ''); };
  if (document.documentElement.scrollWidth > vw + 1)
    out.push(`page: ${document.documentElement.scrollWidth} px wide in a ${vw} px window`);
  const panel = document.getElementById('tab-' + tab);
  const shown = e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0 &&
    getComputedStyle(e).visibility !== 'hidden'; };
  const skip = e => e.closest('input, textarea, select, .gb-board-tip, .kv-tip, .gb-chart-tip, ' +
    '[role=listbox], .modebar, .sr-only');
  for (const e of [panel, ...panel.querySelectorAll('*')]) {
    if (skip(e) || !shown(e)) continue;
    const st = getComputedStyle(e), r = e.getBoundingClientRect();
    if (r.right > vw + 1 || r.left < -1)
      out.push(`${name(e)}: sticks out of the window (${Math.round(r.left)}..${Math.round(r.right)} of ${vw})`);
    const clips = ['hidden', 'clip', 'auto', 'scroll'].includes(st.overflowX);
    if (clips && e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0)
      out.push(`${name(e)}: content ${e.scrollWidth} px wide in a ${e.clientWidth} px box (${st.overflowX})`);
    // text wider than its own box spills over what is beside it, or is cut where it ends
    const ownText = !(e instanceof SVGElement) && [...e.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (ownText && !clips && e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0)
      out.push(`${name(e)}: text "${e.textContent.trim().slice(0, 40)}" ${e.scrollWidth} px wide in a ${e.clientWidth} px box`);
    if (e.matches('[data-cut]') && +e.dataset.cut > 0)
      out.push(`${name(e)}: ${e.dataset.cut} label(s) shortened to fit`);
    // a canvas chart's own record of the labels it drew (views/text_boxes.js)
    if (e.matches('[data-overlaps]') && +e.dataset.overlaps > 0)
      out.push(`${name(e)}: ${e.dataset.overlaps} label(s) drawn over others: ${e.dataset.overlapText}`);
    if (e.tagName === 'CANVAS' && e.parentElement &&
        e.getBoundingClientRect().right > e.parentElement.getBoundingClientRect().right + 1)
      out.push(`${name(e)}: canvas wider than its box`);
  }
  // plotly: each label inside its figure
  for (const svg of panel.querySelectorAll('.js-plotly-plot svg.main-svg:first-of-type')) {
    if (!shown(svg)) continue;
    const box = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      if (r.width && (r.left < box.left - 1 || r.right > box.right + 1))
        out.push(`${name(svg)}: label "${t.textContent.slice(0, 40)}" runs past the figure`);
    }
    // titles, legend entries and annotations never on top of each other
    const plot = svg.closest('.js-plotly-plot');
    const texts = [...plot.querySelectorAll('.gtitle, .legendtext, .annotation-text')]
      .map(t => [t, t.getBoundingClientRect()]).filter(([, r]) => r.width > 0);
    for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
      const [a, ra] = texts[i], [b, rb] = texts[j];
      const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
      const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
      if (w > 2 && h > 2)
        out.push(`${name(plot)}: "${a.textContent.slice(0, 30)}" overlaps "${b.textContent.slice(0, 30)}"`);
    }
    // a callout's arrow never strikes through another text (its own label excepted)
    for (const arrow of plot.querySelectorAll('.annotation-arrow-g path')) {
      const ra = arrow.getBoundingClientRect(), own = arrow.closest('.annotation');
      for (const [t, rt] of texts) {
        if (t.closest('.annotation') === own) continue;
        const w = Math.min(ra.right, rt.right) - Math.max(ra.left, rt.left);
        const h = Math.min(ra.bottom, rt.bottom) - Math.max(ra.top, rt.top);
        if (w >= 0 && h > 2)
          out.push(`${name(plot)}: an arrow strikes through "${t.textContent.slice(0, 30)}"`);
      }
    }
  }
  return [...new Set(out)];
}"""


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_every_tab_fits_its_window_while_a_reply_streams(running, browser, size):
    w, h = size
    page = quiet_context(browser, w, h).new_page()
    page.set_default_timeout(60_000)
    page.goto(running.url)
    page.wait_for_selector("#chat-input textarea")
    # this page's own reply (what its Chat and Layers tabs show), then replies that keep
    # streaming on the server while every tab is looked at
    send(page, "Write a very long list of colours, one per line.", 400)
    wait_until(lambda: page.locator("[data-testid=bot]").count() > 0, timeout=60)
    problems = {}
    with ReplyDriver(running):
        for tab in TABS:
            show_tab(page, tab)
            page.wait_for_selector(READY[tab], state="visible")
            page.wait_for_timeout(1500)             # a few live updates: labels as they stream
            assert running.hub.snapshot(max_age=0).running, "no reply streams"
            found = page.evaluate(FIT_JS, [tab])
            if found:
                problems[tab] = found
            screenshot(page, f"fit_{w}x{h}_{tab}")
    page.context.close()
    assert not problems, "clipped at {}×{}:\n".format(w, h) + "\n".join(
        f"  {tab}: {p}" for tab, ps in problems.items() for p in ps)
