// A live plotly figure: one div for the page's lifetime, updated with Plotly.react (a diff)
// whenever the gr.HTML's value (the figure's JSON) changes, so an update redraws only what
// changed and zoom survives (uirevision). A click on a point becomes trigger('click', {x, y,
// curve}). Runs as a gr.HTML js_on_load: `element`, `props`, `watch`, `trigger` are Gradio's.
const div = element.querySelector('.gb-plot');
const config = {displaylogo: false, responsive: true,
                modeBarButtonsToRemove: ['select2d', 'lasso2d', 'toImage']};
let renders = 0, bound = false, shown = null, queued = false;

// draw in the next animation frame: the Gradio event that brought the value completes at
// once, so the next tick's request overlaps this drawing; values that arrive meanwhile
// coalesce (only the newest is drawn)
function schedule() {
  if (queued) return;
  queued = true;
  requestAnimationFrame(() => { queued = false; render(); });
}

function render() {
  const P = window.Plotly;
  const v = props.value;
  if (!P || !v || v === shown) return;
  shown = v;
  const fig = typeof v === 'string' ? JSON.parse(v) : v;
  P.react(div, fig.data || [], fig.layout || {}, config);
  renders += 1;
  div.dataset.renders = renders;
  if (!bound && div.on) {
    bound = true;
    div.on('plotly_click', (ev) => {
      const p = ev && ev.points && ev.points[0];
      if (p) trigger('click', {x: p.x, y: p.y, curve: p.curveNumber});
    });
  }
}

watch('value', schedule);
(function whenLoaded() {     // plotly.js comes from the page head; it may still be loading
  if (window.Plotly) render(); else setTimeout(whenLoaded, 50);
})();
// a plot drawn in a hidden tab has no width: resize it when it shows
let lastWidth = 0, resizeQueued = false;
new ResizeObserver(() => {
  if (resizeQueued) return;
  resizeQueued = true;
  requestAnimationFrame(() => {
    resizeQueued = false;
    const w = div.clientWidth;
    if (window.Plotly && div.data && w > 0 && Math.abs(w - lastWidth) > 1) {
      lastWidth = w;
      window.Plotly.Plots.resize(div);
    }
  });
}).observe(div);
