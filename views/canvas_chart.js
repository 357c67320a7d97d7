// A canvas chart for the Layers tab: a heatmap (cells, optional cell text, outlines, markers,
// colour bar) or side-by-side bar panels, drawn from the compact spec that
// views/figures_layers.py builds. A redraw costs a few milliseconds where a plotly figure of
// the same data costs tens (axes, legends and label measuring on every update), so the tab
// keeps up with the tokens on two cores. Hover shows a card; a click becomes
// trigger('click', {row, col, x, y}). Runs as a gr.HTML js_on_load (`element`, `props`,
// `watch`, `trigger` are Gradio's).
const root = element.querySelector('.gb-chart');
const canvas = root.querySelector('canvas');
const tip = root.querySelector('.gb-chart-tip');
const FONT = '12px Inter, system-ui, sans-serif';
let spec = null, specFrom = null, geom = null, renders = 0;
const luts = new Map();

function parseColour(c) {
  if (c[0] === '#') return [1, 3, 5].map(i => parseInt(c.slice(i, i + 2), 16));
  return c.match(/[\d.]+/g).slice(0, 3).map(Number);
}

function lut(stops) {                 // 256 rgb entries interpolated from [[pos, colour], ...]
  const key = JSON.stringify(stops);
  if (luts.has(key)) return luts.get(key);
  const cs = stops.map(([p, c]) => [p, parseColour(c)]);
  const out = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const t = i / 255;
    let k = 0;
    while (k < cs.length - 2 && t > cs[k + 1][0]) k++;
    const [p0, c0] = cs[k], [p1, c1] = cs[k + 1];
    const f = p1 > p0 ? Math.min(1, Math.max(0, (t - p0) / (p1 - p0))) : 0;
    for (let j = 0; j < 3; j++) out[3 * i + j] = Math.round(c0[j] + f * (c1[j] - c0[j]));
  }
  luts.set(key, out);
  return out;
}

function niceStep(span, target) {
  const raw = span / Math.max(1, target), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
}

let boxes = [];             // this drawing's labels (views/text_boxes.js)
function text(ctx, s, x, y, align = 'left', base = 'middle', colour = '#2a3f5f', keep = true) {
  ctx.fillStyle = colour; ctx.textAlign = align; ctx.textBaseline = base; ctx.fillText(s, x, y);
  if (keep) boxes.push(textBox(ctx, s, x, y, align, base));
}

// labels shortened to fit in the last drawing (root.dataset.cut; tests/test_browser_fit.py)
let cut = 0;

// the font (from `px` down to 11 px) at which `s` fits `maxW`; past that, `s` cut with an
// ellipsis (and counted): a title is never cut silently at the canvas edge
function fitted(ctx, s, maxW, px = 14) {
  for (let f = px; f >= 11; f--) {
    ctx.font = `${f}px Inter, system-ui, sans-serif`;
    if (ctx.measureText(s).width <= maxW) return s;
  }
  cut += 1;
  let k = s.length;
  while (k > 1 && ctx.measureText(s.slice(0, k) + '…').width > maxW) k--;
  return s.slice(0, k) + '…';
}

// an axis title centred under [lo, hi] where it fits, else moved in so it stays inside
// [0, width] (a narrow panel at the right edge cut "physical KV block")
function axisTitle(ctx, s, lo, hi, y, width) {
  const t = fitted(ctx, s, width - 8, 12), w = ctx.measureText(t).width;
  const x = Math.min(Math.max((lo + hi) / 2, w / 2 + 4), width - w / 2 - 4);
  text(ctx, t, x, y, 'center', 'middle', '#495057');
  ctx.font = FONT;
}

function drawTitle(ctx, s, width) {
  text(ctx, fitted(ctx, s || '', width - 16), 8, 14, 'left', 'middle', '#2a3f5f');
  ctx.font = FONT;
}

// the height under the plot that x labels turned 60° take: 6 px to the label, 0.87 of the
// longest label's width down, half a line more for its thickness (none: one row of ticks)
function turnedLabelsHeight(lw, labelled) {
  return labelled ? Math.ceil(6 + 0.87 * lw + 8) : 18;
}

function drawHeatmap(ctx, s, width, height) {
  const rows = s.z.length, cols = rows ? s.z[0].length : 0;
  const xl = s.x_labels, labelled = xl && xl.length && cols <= 48;
  ctx.font = FONT;
  const yw = Math.max(24, ...s.y_labels.map(l => ctx.measureText(l).width)) + 10;
  const lw = labelled ? Math.max(...xl.map(l => ctx.measureText(l).width)) : 0;
  const bottom = turnedLabelsHeight(lw, labelled) + (s.x_title ? 20 : 4);
  // the colour bar's ticks and title are as wide as they are, not a fixed 62 px
  const cb = s.colorbar;
  // (bar 14 px off the plot, 12 wide, ticks 4 px past it; the title starts at the bar)
  const right = cb ? 34 + Math.max(20, ...(cb.ticks || []).map(([, l]) => ctx.measureText(l).width),
                                   cb.title ? ctx.measureText(cb.title).width - 16 : 0) : 12;
  const span = Math.max(cols, s.x_end || cols);       // the x range may run past the data
  // the first turned label reaches half its width left of its tick
  const px = Math.max(yw, labelled ? 0.5 * lw + 4 : 0), py = (s.vlines || []).some(m => m.label) ? 40 : 28, pw = Math.max(40, width - px - right), ph = Math.max(20, height - py - bottom);
  const cw = pw / span, rh = ph / Math.max(rows, 1);
  geom = {px, py, pw, ph, cw, rh, rows, cols};
  // cells: one pixel each in an offscreen image, scaled up without smoothing
  const colours = lut(s.colorscale), zmin = s.zmin, zr = (s.zmax - s.zmin) || 1;
  if (rows && cols) {
    const img = new ImageData(cols, rows);
    for (let r = 0; r < rows; r++) {
      const row = s.z[r];
      for (let c = 0; c < cols; c++) {
        const v = row[c], o = 4 * (r * cols + c);
        if (v === null || v === undefined) { img.data.set([241, 243, 245, 255], o); continue; }
        const i = 3 * Math.round(255 * Math.min(1, Math.max(0, (v - zmin) / zr)));
        img.data[o] = colours[i]; img.data[o + 1] = colours[i + 1]; img.data[o + 2] = colours[i + 2];
        img.data[o + 3] = 255;
      }
    }
    const off = document.createElement('canvas');
    off.width = cols; off.height = rows;
    off.getContext('2d').putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(off, px, py, cols * cw, ph);
  }
  // cell text (the logit lens' top tokens) where it fits
  if (s.cell_text && cw >= 16 && rh >= 11) {
    ctx.font = '10px Inter, system-ui, sans-serif';
    for (let r = 0; r < rows; r++) {
      for (let c = 0; c < cols; c++) {
        const t = s.cell_text[r][c], v = s.z[r][c];
        if (!t) continue;
        const dark = v !== null && (v - zmin) / zr > (s.dark_above ?? 0.55);
        ctx.save(); ctx.beginPath(); ctx.rect(px + c * cw, py + r * rh, cw, rh); ctx.clip();
        text(ctx, t, px + (c + 0.5) * cw, py + (r + 0.5) * rh, 'center', 'middle',
             dark ? '#fff' : '#212529', false);      // clipped to its cell: never over a label
        ctx.restore();
      }
    }
    ctx.font = FONT;
  }
  // marks: grey spans (e.g. prefix-cached tokens), outlines, lines, markers
  for (const m of s.spans || []) {
    const x0 = px + m.from * cw, w = (m.to - m.from) * cw;
    if (m.fill) { ctx.fillStyle = m.fill; ctx.fillRect(x0, py, w, ph); }
    // the label only where it fits inside its span, never over the cells beside it
    if (m.label && ctx.measureText(m.label).width + 6 <= w) {
      ctx.save(); ctx.beginPath(); ctx.rect(x0, py, w, ph); ctx.clip();
      text(ctx, m.label, x0 + 3, py + 8, 'left', 'middle', '#495057'); ctx.restore();
    }
  }
  for (const m of s.vlines || []) {
    ctx.strokeStyle = m.colour; ctx.setLineDash([4, 3]); ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(px + m.at * cw, py); ctx.lineTo(px + m.at * cw, py + ph); ctx.stroke();
    ctx.setLineDash([]);
    if (m.label) {                    // named above the plot, beside the title's baseline
      ctx.font = '10px Inter, system-ui, sans-serif';
      text(ctx, m.label, px + m.at * cw + 2, py - 6, 'left', 'middle', '#495057');
      ctx.font = FONT;
    }
  }
  ctx.lineWidth = 2;
  for (const m of s.col_outlines || []) {
    ctx.strokeStyle = m.colour; ctx.strokeRect(px + m.from * cw + 1, py + 1, (m.to - m.from) * cw - 2, ph - 2);
  }
  for (const m of s.row_outlines || []) {
    ctx.strokeStyle = m.colour; ctx.strokeRect(px + 1, py + m.from * rh + 1, cols * cw - 2, (m.to - m.from) * rh - 2);
  }
  for (const [r, c] of s.markers || []) {
    ctx.strokeStyle = s.marker_colour || '#e15759';
    ctx.beginPath(); ctx.arc(px + (c + 0.5) * cw, py + (r + 0.5) * rh, Math.max(3, Math.min(cw, rh) / 2.6), 0, 2 * Math.PI); ctx.stroke();
  }
  ctx.lineWidth = 1;
  // axes: row labels, column ticks, titles
  const every = Math.max(1, Math.ceil(12 / rh));
  s.y_labels.forEach((l, r) => { if (r % every === 0) text(ctx, l, px - 6, py + (r + 0.5) * rh, 'right'); });
  let labelEvery = 0;                 // rotated labels drawn >= 14 px apart, the rest thinned
  if (labelled) {
    labelEvery = Math.max(1, Math.ceil(14 / cw));
    geom.labelEvery = labelEvery;
    xl.forEach((l, c) => {
      if (c % labelEvery) return;
      ctx.save(); ctx.translate(px + (c + 0.5) * cw, py + ph + 6); ctx.rotate(-Math.PI / 3);
      text(ctx, l, 0, 0, 'right', 'middle'); ctx.restore();
    });
  } else {
    const step = niceStep(span, Math.max(2, Math.floor(pw / 70)));
    for (let v = 0; v < span; v += step) {
      const x = px + (v + 0.5) * cw;
      ctx.strokeStyle = '#adb5bd'; ctx.beginPath(); ctx.moveTo(x, py + ph); ctx.lineTo(x, py + ph + 4); ctx.stroke();
      text(ctx, String((s.x_start || 0) + v), x, py + ph + 12, 'center');
    }
  }
  if (s.x_title) axisTitle(ctx, s.x_title, px, px + pw, height - 9, width);
  if (cb) {                     // below its title, so the top tick never meets it
    const bx = px + pw + 14, bw = 12, by = py + (cb.title ? 16 : 0);
    const bh = Math.max(10, py + ph - by);
    for (let i = 0; i < bh; i++) {
      const k = 3 * Math.round(255 * (1 - i / Math.max(1, bh - 1)));
      ctx.fillStyle = `rgb(${colours[k]},${colours[k + 1]},${colours[k + 2]})`;
      ctx.fillRect(bx, by + i, bw, 1);
    }
    let lastY = -1e9;
    for (const [v, l] of [...(cb.ticks || [])].sort((a, b) => b[0] - a[0])) {
      const y = by + bh * (1 - (v - zmin) / zr);
      if (y - lastY < 11) continue;                 // never two labels on top of each other
      text(ctx, l, bx + bw + 4, y, 'left');
      lastY = y;
    }
    if (cb.title) text(ctx, cb.title, bx, py + 4, 'left', 'middle', '#495057');
  }
}

function drawBars(ctx, s, width, height) {
  ctx.font = FONT;
  let x0 = 0;
  geom = {panels: []};
  const gap = 24;
  const usable = width - gap * (s.panels.length - 1);
  s.panels.forEach((p, k) => {
    const w = usable * p.width, n = p.values.length;
    const labelled = p.labels && n <= 48;
    const lw = labelled ? Math.max(...p.labels.map(l => ctx.measureText(l).width)) : 0;
    const left = 52, bottom = turnedLabelsHeight(lw, labelled) + (p.x_title ? 20 : 4);
    const px = x0 + left, py = 28, pw = Math.max(20, w - left - 6), ph = Math.max(20, height - py - bottom);
    const bw = pw / Math.max(n, 1), top = p.ymax || 1;
    ctx.fillStyle = p.colour;
    p.values.forEach((v, i) => {
      const h = ph * Math.min(1, v / top);
      ctx.fillRect(px + i * bw + (bw > 3 ? 0.5 : 0), py + ph - h, Math.max(1, bw - (bw > 3 ? 1 : 0)), h);
    });
    ctx.strokeStyle = '#adb5bd'; ctx.beginPath(); ctx.moveTo(px, py + ph); ctx.lineTo(px + pw, py + ph); ctx.stroke();
    for (const f of [0, 0.5, 1]) text(ctx, (top * f).toFixed(top >= 1 ? 1 : 2), px - 6, py + ph * (1 - f), 'right');
    if (labelled) {
      const every = Math.max(1, Math.ceil(14 / bw));     // rotated labels >= 14 px apart
      p.labels.forEach((l, i) => {
        if (i % every) return;
        ctx.save(); ctx.translate(px + (i + 0.5) * bw, py + ph + 6); ctx.rotate(-Math.PI / 3);
        text(ctx, l, 0, 0, 'right'); ctx.restore();
      });
    } else if (p.tick_labels) {
      // as many ticks as the widest one fits with a gap, so long ids never crowd
      const longest = p.tick_labels.reduce((a, l) => (l.length > a.length ? l : a), '');
      const tw = ctx.measureText(longest).width;
      const step = Math.max(1, Math.ceil(n / Math.max(2, Math.floor(pw / Math.max(60, tw + 24)))));
      for (let i = 0; i < n; i += step) text(ctx, p.tick_labels[i], px + (i + 0.5) * bw, py + ph + 12, 'center');
    }
    if (p.x_title) axisTitle(ctx, p.x_title, px, px + pw, height - 9, width);
    if (p.y_title) { ctx.save(); ctx.translate(x0 + 10, py + ph / 2); ctx.rotate(-Math.PI / 2); text(ctx, p.y_title, 0, 0, 'center', 'middle', '#495057'); ctx.restore(); }
    geom.panels.push({px, py, pw, ph, bw, n});
    x0 += w + gap;
  });
}

function data() {
  if (props.value !== specFrom) {
    specFrom = props.value;
    spec = typeof specFrom === 'string' && specFrom ? JSON.parse(specFrom) : (specFrom || null);
    if (spec && spec.z && spec.z.b64 !== undefined) spec.z = unpack(spec.z);
    if (spec && spec.lens_hover) {          // numbers for the lens' hovers (written on hover)
      for (const key of ['ids', 'p', 'rank', 'sp', 'entropy']) spec.lens_hover[key] = unpack(spec.lens_hover[key]);
    }
  }
  return spec;
}

// a packed matrix (views/canvas_chart.py pack_matrix): float32 rows, NaN read as null
function unpack(m) {
  const bin = atob(m.b64), bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  const f = new Float32Array(bytes.buffer), rows = [];
  for (let r = 0; r < m.rows; r++) {
    const row = new Array(m.cols);
    for (let c = 0; c < m.cols; c++) { const v = f[r * m.cols + c]; row[c] = Number.isNaN(v) ? null : v; }
    rows.push(row);
  }
  return rows;
}

function draw() {
  const s = data();
  if (!s) return;
  const width = Math.max(200, root.clientWidth || 600), height = s.height || 300;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  canvas.style.width = width + 'px'; canvas.style.height = height + 'px';
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = '#fff'; ctx.fillRect(0, 0, width, height);
  cut = 0;
  boxes = [];
  drawTitle(ctx, s.title, width);
  if (s.message) {
    text(ctx, s.message, width / 2, height / 2, 'center', 'middle', '#6c757d');
    geom = null;
  } else if (s.kind === 'bars') drawBars(ctx, s, width, height);
  else drawHeatmap(ctx, s, width, height);
  renders += 1;
  root.dataset.renders = renders;
  root.dataset.title = s.title || '';
  root.dataset.cut = cut;
  writeTextProblems(root, boxes, width, height);
  root.dataset.labelEvery = (geom && geom.labelEvery) || '';
}

function cellAt(ev) {
  const s = data();
  if (!s || !geom) return null;
  const r = canvas.getBoundingClientRect(), x = ev.clientX - r.left, y = ev.clientY - r.top;
  if (s.kind === 'bars') {
    for (const [k, g] of geom.panels.entries()) {
      const i = Math.floor((x - g.px) / g.bw);
      if (x >= g.px && y >= g.py && y <= g.py + g.ph && i >= 0 && i < g.n) return {panel: k, i};
    }
    return null;
  }
  const c = Math.floor((x - geom.px) / geom.cw), row = Math.floor((y - geom.py) / geom.rh);
  if (c < 0 || c >= geom.cols || row < 0 || row >= geom.rows) return null;
  return {row, col: c};
}

// one logit-lens cell's hover from the numbers the server sent (views/figures_layers.py
// lens_hover_text writes the same text): top-k guesses, the sampled token's rank and p, entropy
function lensHover(L, r, c) {
  const q = (id) => JSON.stringify(L.texts[String(id)] ?? String(id));
  const guesses = [];
  for (let j = 0; j < L.k; j++) guesses.push(`${q(L.ids[r][c * L.k + j])} ${Number(L.p[r][c * L.k + j]).toFixed(2)}`);
  return `next-token guesses: ${guesses.join(', ')}\nsampled ${q(L.sampled[c])}: rank ${L.rank[r][c]}, ` +
    `p=${Number(L.sp[r][c]).toFixed(2)} · entropy ${Number(L.entropy[r][c]).toFixed(2)} nats`;
}

function hoverText(s, h) {
  if (s.kind === 'bars') {
    const p = s.panels[h.panel];
    return (p.hover ? p.hover[h.i] : String(h.i)) + `\n${p.value_name || 'value'} ${Number(p.values[h.i]).toFixed(4)}`;
  }
  const v = s.z[h.row][h.col];
  const x = s.x_labels ? s.x_labels[h.col] : (s.x_start || 0) + h.col;
  let out = `${s.y_labels[h.row]} · ${s.x_name || 'x'} ${x}`;
  if (s.col_text) out += ` “${s.col_text[h.col]}”`;
  out += `\n${s.value_name || 'value'} ${v === null ? '—' : Number(s.value_fmt === 'p' ? v * v : v).toPrecision(3)}`;
  if (s.cell_hover) out += '\n' + s.cell_hover[h.row][h.col];
  if (s.lens_hover) out += '\n' + lensHover(s.lens_hover, h.row, h.col);
  if (s.click_hint) out += '\n' + s.click_hint;
  return out;
}

canvas.addEventListener('mousemove', (ev) => {
  const s = data(), h = cellAt(ev);
  if (!s || !h) { tip.style.display = 'none'; return; }
  const r = root.getBoundingClientRect();
  tip.textContent = hoverText(s, h);
  tip.style.left = Math.min(ev.clientX - r.left + 14, r.width - 200) + 'px';
  tip.style.top = (ev.clientY - r.top + 14) + 'px';
  tip.style.display = 'block';
});
canvas.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
canvas.addEventListener('click', (ev) => {
  const s = data(), h = cellAt(ev);
  if (!s || !h || s.kind === 'bars') return;
  const x = s.x_values ? s.x_values[h.col] : (s.x_start || 0) + h.col;
  trigger('click', {row: h.row, col: h.col, x, y: s.y_labels[h.row]});
});
// the centre of a cell in page coordinates (the browser tests click it)
root.cellCenter = (row, col) => {
  if (!geom || geom.cw === undefined) return null;
  const r = canvas.getBoundingClientRect();
  return {x: r.left + geom.px + (col + 0.5) * geom.cw, y: r.top + geom.py + (row + 0.5) * geom.rh};
};

let queued = false;           // draw in the next frame; values arriving meanwhile coalesce
watch('value', () => {
  if (queued) return;
  queued = true;
  requestAnimationFrame(() => { queued = false; draw(); });
});
let lastWidth = 0, resizeQueued = false;
new ResizeObserver(() => {
  if (resizeQueued) return;
  resizeQueued = true;
  requestAnimationFrame(() => {
    resizeQueued = false;
    if (Math.abs(root.clientWidth - lastWidth) > 1) { lastWidth = root.clientWidth; draw(); }
  });
}).observe(root);
draw();
