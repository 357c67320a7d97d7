// The KV block map: one canvas cell per physical block, drawn from the compact JSON that
// views/figures_kv.py:kv_map_data builds (a redraw costs a millisecond or two, whatever the
// cache size). Runs as a gr.HTML js_on_load: `element`, `props`, `watch`, `trigger` and
// `server` (server.block_detail) are Gradio's.
const canvas = element.querySelector('canvas.kv-canvas');
const legend = element.querySelector('.kv-legend');
const note = element.querySelector('.kv-note');
const tip = element.querySelector('.kv-tip');
const root = element.querySelector('.kv-map');
const SIZES = [18, 16, 14, 12, 10, 8, 6, 5, 4];
const MAX_HEIGHT = 420;
const PAD = 6;
let layout = null;          // {cols, cell, gap, order: [block id per drawn cell]}
let byId = new Map();       // block id -> index into the data arrays
let draws = 0;
// cached-free blocks (old chats' prefixes) crowd the live ones: drawn as free until the
// legend's "show" box is ticked; the choice is kept per browser
let showCached = localStorage.getItem('gb-kv-show-cached') === '1';

function pickLayout(n, width) {
  for (const cell of SIZES) {
    const gap = cell >= 10 ? 3 : 1;
    const cols = Math.max(1, Math.floor((width - 2 * PAD + gap) / (cell + gap)));
    const rows = Math.ceil(n / cols);
    if (rows * (cell + gap) <= MAX_HEIGHT || cell === SIZES[SIZES.length - 1]) {
      return {cols, rows, cell, gap};
    }
  }
}

function hatch(ctx, x, y, s) {
  ctx.save();
  ctx.beginPath(); ctx.rect(x, y, s, s); ctx.clip();
  ctx.strokeStyle = 'rgba(255,255,255,0.8)'; ctx.lineWidth = 1;
  ctx.beginPath();
  for (let d = -s; d < s; d += 4) { ctx.moveTo(x + d, y + s); ctx.lineTo(x + d + s, y); }
  ctx.stroke();
  ctx.restore();
}

const PACKED = {u1: Uint8Array, i1: Int8Array, u2: Uint16Array, i2: Int16Array, i4: Int32Array};
let parsedFrom = null, parsed = null;
function data() {            // the value is the map's JSON as a string: parse it once
  if (props.value !== parsedFrom) {
    parsedFrom = props.value;
    parsed = typeof parsedFrom === 'string' ? JSON.parse(parsedFrom || '{}') : parsedFrom;
    // views/figures_kv.py kv_map_json packs the parallel arrays as base64, each in its own type
    for (const k of ['ids', 'state', 'fill', 'ref', 'owner']) {
      const a = parsed && parsed[k];
      if (a && a.b64 !== undefined) {
        const bin = atob(a.b64), bytes = new Uint8Array(bin.length);
        for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
        const T = PACKED[a.dtype || 'i4'];     // figures_kv.pack_ints: the narrowest type
        parsed[k] = Array.from(new T(bytes.buffer, 0, a.n));
      }
    }
  }
  return parsed;
}

function draw() {
  const v = data();
  if (!v || !v.num_blocks) return;
  const width = Math.max(200, (root.clientWidth || 800) - 2);   // less the canvas border
  byId = new Map(v.ids.map((id, i) => [id, i]));
  const order = v.shown != null ? null : v.ids;      // null: ids 0..shown-1
  const n = order ? order.length : v.shown;
  const L = pickLayout(Math.max(n, 1), width);
  const height = 2 * PAD + L.rows * (L.cell + L.gap) - L.gap;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * dpr); canvas.height = Math.round(height * dpr);
  canvas.style.width = width + 'px'; canvas.style.height = height + 'px';
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const s = L.cell, step = L.cell + L.gap, bs = v.block_size;
  for (let k = 0; k < n; k++) {
    const id = order ? order[k] : k;
    const x = PAD + (k % L.cols) * step, y = PAD + Math.floor(k / L.cols) * step;
    const i = byId.get(id);
    ctx.fillStyle = v.colour_free;
    ctx.fillRect(x, y, s, s);
    if (i === undefined) continue;                   // free
    const st = v.state[i];
    if (st === 1) {                                  // cached but free (evictable)
      if (!showCached) continue;
      ctx.fillStyle = v.colour_evictable; ctx.fillRect(x, y, s, s);
      if (s >= 8) hatch(ctx, x, y, s);
      continue;
    }
    const colour = v.owner[i] >= 0 ? v.colours[v.owner[i]] : '#495057';
    const h = Math.max(1, Math.round(s * Math.min(1, v.fill[i] / bs)));   // fills like a glass
    ctx.fillStyle = colour; ctx.fillRect(x, y + s - h, s, h);
    ctx.strokeStyle = colour; ctx.lineWidth = 1; ctx.strokeRect(x + 0.5, y + 0.5, s - 1, s - 1);
    if (st === 3) {                                  // shared (ref > 1): dark outline, white dot
      ctx.strokeStyle = '#212529'; ctx.lineWidth = s >= 10 ? 2 : 1;
      ctx.strokeRect(x + 1, y + 1, s - 2, s - 2);
      if (s >= 8) {
        ctx.fillStyle = '#fff'; ctx.beginPath();
        ctx.arc(x + s / 2, y + s / 2, Math.max(1.5, s / 7), 0, 2 * Math.PI); ctx.fill();
      }
    }
  }
  layout = {cols: L.cols, cell: s, gap: L.gap, order, n};
  const c = v.counts;
  const sw = (cls, colour, label) =>
    `<span><i class="kv-swatch ${cls}" style="background:${colour}"></i>${label}</span>`;
  // the owned / shared swatches show the colours of the requests drawn (one stripe each, up
  // to six), never a colour that is no request's
  const inUse = v.colours.slice(0, 6), stripes = inUse.length
    ? `linear-gradient(90deg, ${inUse.map((col, k) => `${col} ${100 * k / inUse.length}% ` +
                                           `${100 * (k + 1) / inUse.length}%`).join(', ')})`
    : '#495057';
  legend.innerHTML = [
    sw('kv-owned', stripes, `owned ${c.owned} (colour = request)`),
    sw('kv-shared', stripes, `shared (ref&gt;1: dark border, white dot) ${c.shared}`),
    sw('kv-evictable', v.colour_evictable, `cached, free (evictable) ${c.evictable} ` +
       `<label><input type="checkbox" class="kv-show-cached"${showCached ? ' checked' : ''}>` +
       `show</label>`),
    sw('kv-free', v.colour_free, `free ${c.free}`),
    `<span class="kv-legend-fill">fill = slots written / ${bs} · hover a block for its text, ` +
    `click it for its K/V numbers</span>`].join('');
  note.textContent = order
    ? `showing the ${n} busy blocks of ${v.num_blocks} (free ones left out)`
    : (n < v.num_blocks ? `showing blocks 0–${n - 1} of ${v.num_blocks}: the region in use; ` +
                          `blocks ${n}–${v.num_blocks - 1} are free` : '');
  draws += 1;
  root.dataset.draws = draws;
  root.dataset.showCached = showCached ? '1' : '0';
  root.dataset.cells = n;
  root.dataset.owners = v.owners.join(',');
  root.dataset.shared = c.shared;
}

function cellAt(ev) {
  if (!layout) return null;
  const r = canvas.getBoundingClientRect();
  const step = layout.cell + layout.gap;
  const col = Math.floor((ev.clientX - r.left - PAD) / step);
  const row = Math.floor((ev.clientY - r.top - PAD) / step);
  const k = row * layout.cols + col;
  if (col < 0 || col >= layout.cols || row < 0 || k >= layout.n) return null;
  return layout.order ? layout.order[k] : k;
}

// the centre of a block's cell in page coordinates (the browser tests hover and click it)
root.kvCellCenter = (id) => {
  if (!layout) return null;
  const k = layout.order ? layout.order.indexOf(id) : id;
  if (k < 0 || k >= layout.n) return null;
  const r = canvas.getBoundingClientRect(), step = layout.cell + layout.gap;
  return {x: r.left + PAD + (k % layout.cols) * step + layout.cell / 2,
          y: r.top + PAD + Math.floor(k / layout.cols) * step + layout.cell / 2};
};

// the hover card lives on <body> with fixed position: inside the map's box (overflow hidden,
// CSS containment) it was clipped at the box's edge; here it is kept inside the window
document.body.appendChild(tip);
tip.style.position = 'fixed';
function placeTip(ev) {
  tip.style.display = 'block';
  const w = tip.offsetWidth, h = tip.offsetHeight;
  let x = ev.clientX + 14, y = ev.clientY + 14;
  if (x + w > window.innerWidth - 4) x = Math.max(4, ev.clientX - w - 10);
  if (y + h > window.innerHeight - 4) y = Math.max(4, ev.clientY - h - 10);
  tip.style.left = x + 'px'; tip.style.top = y + 'px';
}
let lastEv = null;
new MutationObserver(() => { if (lastEv && tip.style.display === 'block') placeTip(lastEv); })
  .observe(tip, {childList: true, characterData: true, subtree: true});

let hovered = null, pending = null;
canvas.addEventListener('mousemove', (ev) => {
  const id = cellAt(ev);
  if (id === null) { tip.style.display = 'none'; hovered = null; return; }
  lastEv = ev;
  placeTip(ev);
  if (id === hovered) return;
  hovered = id;
  const v = data(), i = byId.get(id);
  const states = ['free', 'evictable', 'owned', 'shared'];
  tip.textContent = i === undefined ? `block ${id} · free`
    : `block ${id} · ${states[v.state[i]]} · ref ${v.ref[i]} · filled ${v.fill[i]}/${v.block_size}`;
  clearTimeout(pending);
  pending = setTimeout(async () => {               // owners and text come from the server
    try {
      const text = await server.block_detail(id);
      if (hovered === id) tip.textContent = text;
    } catch (e) { /* the card keeps its short form */ }
  }, 80);
});
legend.addEventListener('change', (ev) => {
  if (!ev.target.classList.contains('kv-show-cached')) return;
  showCached = ev.target.checked;
  localStorage.setItem('gb-kv-show-cached', showCached ? '1' : '0');
  draw();
});
canvas.addEventListener('mouseleave', () => { tip.style.display = 'none'; hovered = null; });
canvas.addEventListener('click', (ev) => {
  const id = cellAt(ev);
  if (id === null) return;
  trigger('click', {block: id});
  // the K/V numbers open below the map: bring them into view, or the click seems to do nothing
  const target = document.getElementById('kv-drill');
  if (target) target.scrollIntoView({behavior: 'smooth', block: 'start'});
});
// redraw when the tab shows or the window resizes (the canvas never widens its box: the
// box's width is the parent's, so drawing cannot feed back into a resize)
let lastWidth = 0, resizeQueued = false;
new ResizeObserver(() => {
  if (resizeQueued) return;
  resizeQueued = true;
  requestAnimationFrame(() => {
    resizeQueued = false;
    if (Math.abs(root.clientWidth - lastWidth) > 1) { lastWidth = root.clientWidth; draw(); }
  });
}).observe(root);
let drawQueued = false;        // draw in the next frame (see views/live_plot.js)
watch('value', () => {
  if (drawQueued) return;
  drawQueued = true;
  requestAnimationFrame(() => { drawQueued = false; draw(); });
});
draw();
