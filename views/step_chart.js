// A board of canvas charts over steps or time (the Engine tab), drawn from the compact specs
// that views/figures_engine.py builds. One gr.HTML holds every chart of the board, so a tick
// is one value and one JSON parse; a value names only the slots that changed, the others keep
// their drawing. A chart is panels stacked on one x axis: "stack" (filled areas, step-shaped,
// plus step lines) or "cells" (one row per request, a cell per step). A plotly figure of the
// same data cost the page's main thread ~100-200 ms per update on two cores (re-layout, label
// measuring); a canvas redraw costs a few ms. A "table" slot is a small HTML table.
// Runs as a gr.HTML js_on_load (`element`, `props`, `watch` are Gradio's).
const board = element.querySelector('.gb-board');
const FONT = '12px Inter, system-ui, sans-serif', SMALL = '11px Inter, system-ui, sans-serif';
const INK = '#2a3f5f', MUTED = '#495057', GRID = '#e9ecef', AXIS = '#adb5bd';
const specs = {};
let tip = document.querySelector('body > .gb-board-tip');
if (!tip) {                  // on the page's body: never clipped by a chart's box
  tip = document.createElement('div');
  tip.className = 'gb-board-tip';
  document.body.appendChild(tip);
}

function niceStep(span, target, int) {
  const raw = span / Math.max(1, target), mag = Math.pow(10, Math.floor(Math.log10(raw || 1)));
  const s = [1, 2, 5, 10].map(m => m * mag).find(v => v >= raw) || raw;
  return int ? Math.max(1, Math.round(s)) : s;
}
function fmt(v, digits) {
  if (v === null || v === undefined) return '—';
  return digits === undefined ? String(Math.round(v * 100) / 100) : Number(v).toFixed(digits);
}
let boxes = [];             // this drawing's labels (views/text_boxes.js)
function text(ctx, s, x, y, align = 'left', base = 'middle', colour = INK) {
  ctx.fillStyle = colour; ctx.textAlign = align; ctx.textBaseline = base; ctx.fillText(s, x, y);
  boxes.push(textBox(ctx, s, x, y, align, base));
}
// the longest tail of `s` that fits `w` px, marked with a leading ellipsis (request ids
// differ at their end)
function fitLeft(ctx, s, w) {
  if (ctx.measureText(s).width <= w) return [s, false];
  let k = 1;
  while (k < s.length && ctx.measureText('…' + s.slice(k)).width > w) k++;
  return ['…' + s.slice(k), true];
}

// title, then the legend's swatches on the same line where they fit, else on the next ones;
// returns the height taken
function drawHeader(ctx, s, width, out) {
  // the title at the largest font (14 down to 11 px) that fits; past that, cut and counted
  let title = s.title || '';
  for (let f = 14; f >= 11; f--) {
    ctx.font = `${f}px Inter, system-ui, sans-serif`;
    if (ctx.measureText(title).width <= width - 16) break;
  }
  if (ctx.measureText(title).width > width - 16) {
    out.cut += 1;
    while (title.length > 1 && ctx.measureText(title + '…').width > width - 16) title = title.slice(0, -1);
    title += '…';
  }
  text(ctx, title, 8, 12, 'left', 'middle', INK);
  let x = 8 + ctx.measureText(title).width + 16, y = 12;
  ctx.font = SMALL;
  for (const [name, colour, style] of s.legend || []) {
    const w = 18 + ctx.measureText(name).width + 12;
    if (x + w > width - 4) { x = 8; y += 16; }
    ctx.strokeStyle = colour; ctx.fillStyle = colour; ctx.lineWidth = 2;
    if (style === 'fill') ctx.fillRect(x, y - 5, 12, 10);
    else {
      ctx.setLineDash(style === 'dash' ? [3, 2] : []);
      ctx.beginPath(); ctx.moveTo(x, y); ctx.lineTo(x + 12, y); ctx.stroke(); ctx.setLineDash([]);
    }
    text(ctx, name, x + 16, y, 'left', 'middle', MUTED);
    x += w;
  }
  ctx.lineWidth = 1; ctx.font = FONT;
  return y + 14;
}

function yTicks(top, int) {
  const step = niceStep(top, 4, int), out = [];
  for (let v = 0; v <= top + 1e-9; v += step) out.push(v);
  return out;
}

function drawStack(ctx, s, p, g) {      // g: {px, py, pw, ph, X(x), lo, hi}
  const n = g.lo.length, series = p.series || [], lines = p.lines || [];
  let top = 0;
  for (let i = 0; i < n; i++) {
    let sum = 0;
    for (const se of series) sum += se.y[i] || 0;
    top = Math.max(top, sum);
    for (const l of lines) if (!l.right && l.y[i] !== null) top = Math.max(top, l.y[i]);
  }
  top = p.ymax || (top > 0 ? top * 1.05 : 1);
  const ticks = yTicks(top, p.int); top = Math.max(top, ticks[ticks.length - 1]);
  const Y = v => g.py + g.ph * (1 - v / top);
  ctx.strokeStyle = GRID;
  for (const v of ticks) {
    ctx.beginPath(); ctx.moveTo(g.px, Y(v)); ctx.lineTo(g.px + g.pw, Y(v)); ctx.stroke();
    text(ctx, fmt(v, p.int ? 0 : undefined), g.px - 6, Y(v), 'right', 'middle', MUTED);
  }
  const base = new Float64Array(n);
  for (const se of series) {            // one rectangle per point: a step-shaped area
    ctx.fillStyle = se.colour; ctx.globalAlpha = 0.8;
    for (let i = 0; i < n; i++) {
      const v = se.y[i] || 0;
      if (v > 0) {
        const x0 = g.X(g.lo[i]), x1 = g.X(g.hi[i]);
        ctx.fillRect(x0, Y(base[i] + v), Math.max(1, x1 - x0), Y(base[i]) - Y(base[i] + v));
      }
      base[i] += v;
    }
    ctx.globalAlpha = 1;
  }
  let rtop = 1;
  for (const l of lines) if (l.right) for (const v of l.y) if (v !== null) rtop = Math.max(rtop, v);
  const rticks = yTicks(rtop, true); rtop = rticks[rticks.length - 1];
  for (const l of lines) {              // step lines; null is a gap
    const Yl = l.right ? (v => g.py + g.ph * (1 - v / rtop)) : Y;
    ctx.strokeStyle = l.colour; ctx.lineWidth = l.width || 1.5;
    ctx.setLineDash(l.dash ? [3, 2] : []);
    ctx.beginPath();
    let on = false;
    for (let i = 0; i < n; i++) {
      const v = l.y[i];
      if (v === null || v === undefined) { on = false; continue; }
      const x0 = g.X(g.lo[i]), x1 = g.X(g.hi[i]), y = Yl(v);
      if (on && Math.abs(g.lo[i] - g.hi[i - 1]) < 1e-6) ctx.lineTo(x0, y); else ctx.moveTo(x0, y);
      ctx.lineTo(x1, y); on = true;
    }
    ctx.stroke(); ctx.setLineDash([]); ctx.lineWidth = 1;
  }
  if (lines.some(l => l.right)) {
    for (const v of rticks) text(ctx, fmt(v, 0), g.px + g.pw + 6, g.py + g.ph * (1 - v / rtop), 'left', 'middle', MUTED);
  }
  return {top, rtop};
}

function drawCells(ctx, s, p, g, out) {
  const rows = p.rows || [], rh = g.ph / Math.max(rows.length, 1);
  const every = Math.max(1, Math.ceil(12 / rh));
  rows.forEach((l, r) => {
    if (r % every) return;
    const [shown, cut] = fitLeft(ctx, l, g.px - 10 - g.titled);
    if (cut) out.cut += 1;
    text(ctx, shown, g.px - 6, g.py + (r + 0.5) * rh, 'right', 'middle', MUTED);
  });
  const kinds = p.kinds || [];
  for (const [i, r, k] of p.cells || []) {
    const x0 = g.X(g.lo[i]), x1 = g.X(g.hi[i]);
    ctx.fillStyle = kinds[k] ? kinds[k][1] : AXIS;
    ctx.fillRect(x0 + 0.5, g.py + r * rh + 0.5, Math.max(1, x1 - x0 - 1), Math.max(1, rh - 1));
  }
}

function drawChart(root, s) {
  const canvas = root.querySelector('canvas');
  const width = Math.max(200, root.clientWidth || 600), height = s.height || 260;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  canvas.style.width = width + 'px'; canvas.style.height = height + 'px';
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, width, height);
  const out = {cut: 0};
  boxes = [];
  const headH = drawHeader(ctx, s, width, out);
  root.geom = null;
  if (s.message || !s.panels) {
    text(ctx, s.message || '', width / 2, (headH + height) / 2, 'center', 'middle', '#6c757d');
  } else {
    ctx.font = FONT;
    const x = s.x, lo = x.lo, hi = x.hi;
    // the left margin fits the longest row label (request ids are never cut where they fit in
    // 45 % of the chart), else the y ticks
    // a panel's turned y title takes the first 18 px: row labels start past it
    const titled = s.panels.some(p => p.y_title) ? 18 : 0;
    let left = 56;
    for (const p of s.panels) {
      if (p.kind === 'cells') for (const l of p.rows) left = Math.max(left, ctx.measureText(l).width + 14 + titled);
    }
    left = Math.min(left, Math.round(0.45 * width));
    const right = s.panels.some(p => (p.lines || []).some(l => l.right)) ? 44 : 14;
    const bottom = 34, gap = 18, px = left, pw = Math.max(40, width - left - right);
    const avail = height - headH - 8 - bottom - gap * (s.panels.length - 1);
    const wsum = s.panels.reduce((a, p) => a + (p.weight || 1), 0);
    const [x0, x1] = x.range;
    const X = v => px + pw * (v - x0) / ((x1 - x0) || 1);
    let py = headH + 8;
    const geoms = [];
    for (const p of s.panels) {
      const ph = Math.max(16, avail * (p.weight || 1) / wsum);
      const g = {px, py, pw, ph, X, lo, hi, titled};
      ctx.save(); ctx.beginPath(); ctx.rect(0, py - 8, width, ph + 16); ctx.clip();
      if (p.kind === 'cells') drawCells(ctx, s, p, g, out); else drawStack(ctx, s, p, g);
      ctx.restore();
      if (p.y_title) {
        ctx.save(); ctx.translate(10, py + ph / 2); ctx.rotate(-Math.PI / 2);
        ctx.font = SMALL; text(ctx, p.y_title, 0, 0, 'center', 'middle', MUTED); ctx.restore();
      }
      ctx.strokeStyle = AXIS; ctx.beginPath(); ctx.moveTo(px, py + ph); ctx.lineTo(px + pw, py + ph); ctx.stroke();
      geoms.push({...g, p});
      py += ph + gap;
    }
    // x ticks under the last panel, >= 70 px apart
    const last = geoms[geoms.length - 1], ty = last.py + last.ph;
    const step = niceStep(x1 - x0, Math.max(2, Math.floor(pw / 70)), x.int);
    for (let v = Math.ceil(x0 / step) * step; v <= x1; v += step) {
      const xx = X(v);
      ctx.strokeStyle = AXIS; ctx.beginPath(); ctx.moveTo(xx, ty); ctx.lineTo(xx, ty + 4); ctx.stroke();
      text(ctx, fmt(v, x.int ? 0 : undefined), xx, ty + 12, 'center', 'middle', MUTED);
    }
    if (x.title) text(ctx, x.title, px + pw / 2, height - 8, 'center', 'middle', MUTED);
    root.geom = {geoms, X, px, pw, x0, x1};
  }
  root.dataset.renders = (+root.dataset.renders || 0) + 1;
  root.dataset.title = s.title || '';
  root.dataset.cut = out.cut;          // labels shortened to fit (the fit test reads it)
  writeTextProblems(root, boxes, width, height);
}

function drawTable(root, s) {          // text content only: nothing from the server is markup
  root.replaceChildren();
  const h = document.createElement('div');
  h.className = 'gb-table-title'; h.textContent = s.title || '';
  root.appendChild(h);
  if (s.rows && s.rows.length) {
    const t = document.createElement('table');
    for (const [k, cells] of [['th', s.head || []], ...s.rows.map(r => ['td', r])]) {
      const tr = document.createElement('tr');
      for (const c of cells) { const e = document.createElement(k); e.textContent = c; tr.appendChild(e); }
      t.appendChild(tr);
    }
    root.appendChild(t);
  }
  if (s.note) { const n = document.createElement('div'); n.className = 'gb-table-note'; n.textContent = s.note; root.appendChild(n); }
  root.dataset.renders = (+root.dataset.renders || 0) + 1;
  root.dataset.title = s.title || '';
}

function draw(slot) {
  const root = board.querySelector(`[data-slot="${slot}"]`), s = specs[slot];
  if (!root || !s) return;
  if (s.kind === 'table') drawTable(root, s); else drawChart(root, s);
}

function hover(root, ev) {
  const s = specs[root.dataset.slot], g = root.geom;
  if (!s || !g) { tip.style.display = 'none'; return; }
  const r = root.getBoundingClientRect(), mx = ev.clientX - r.left, my = ev.clientY - r.top;
  const v = g.x0 + (mx - g.px) / g.pw * (g.x1 - g.x0), x = s.x;
  let i = -1;
  for (let k = 0; k < x.lo.length; k++) if (v >= x.lo[k] && v < x.hi[k]) { i = k; break; }
  const panel = g.geoms.find(q => my >= q.py - 4 && my <= q.py + q.ph + 4);
  if (i < 0 || !panel) { tip.style.display = 'none'; return; }
  const lines = [`${x.name || 'x'} ${x.values[i]}`], p = panel.p;
  if (p.kind === 'cells') {
    const row = Math.floor((my - panel.py) / (panel.ph / Math.max(p.rows.length, 1)));
    const c = (p.cells || []).find(c => c[0] === i && c[1] === row);
    // a cell is [step, row, kind, tokens, start]: the hover text is written here
    const text = c ? `${p.kinds[c[2]][0]} ${c[3]} tok @ ${c[4]}` : 'not in this step';
    if (p.rows[row] !== undefined) lines.push(p.rows[row] + ': ' + text);
  } else {
    for (const se of [...(p.series || []), ...(p.lines || [])]) {
      lines.push(`${se.name}: ${fmt(se.y[i], p.digits)}${se.unit || ''}`);
    }
  }
  tip.textContent = lines.join('\n');
  tip.style.display = 'block';
  const w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = Math.max(4, Math.min(ev.clientX + 14, innerWidth - w - 4)) + 'px';
  tip.style.top = Math.max(4, Math.min(ev.clientY + 14, innerHeight - h - 4)) + 'px';
}

for (const root of board.querySelectorAll('.gb-chart[data-slot]')) {
  root.addEventListener('mousemove', ev => hover(root, ev));
  root.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
  let lastWidth = 0, queued = false;
  new ResizeObserver(() => {           // drawn hidden (no width), or the window was resized
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      if (Math.abs(root.clientWidth - lastWidth) > 1) { lastWidth = root.clientWidth; draw(root.dataset.slot); }
    });
  }).observe(root);
}

let seen = null, queued = false, dirty = new Set();
function take() {                      // the newest value's slots replace the drawn ones
  const v = props.value;
  if (!v || v === seen) return;
  seen = v;
  const parts = typeof v === 'string' ? JSON.parse(v) : v;
  for (const [slot, s] of Object.entries(parts)) { specs[slot] = s; dirty.add(slot); }
}
watch('value', () => {                 // draw in the next frame; values meanwhile coalesce
  take();
  if (queued) return;
  queued = true;
  requestAnimationFrame(() => { queued = false; const d = dirty; dirty = new Set(); d.forEach(draw); });
});
take();
dirty.forEach(draw); dirty = new Set();
