// Text drawn on a chart canvas, kept as boxes so a drawing can say where one label was drawn
// over another or past the canvas edge: the canvas has no DOM text a test could measure.
// Prepended to the chart scripts (views/canvas_chart.py, views/step_chart.py); each drawing
// starts a list, records every label, and writes the count and the first few on its root's
// dataset (`overlaps`, `overlapText`), which tests/test_browser_fit.py reads.
function textBox(ctx, s, x, y, align, base) {
  const w = ctx.measureText(s).width, h = parseFloat(/(\d+(?:\.\d+)?)px/.exec(ctx.font)[1]);
  const x0 = align === 'right' ? x - w : align === 'center' ? x - w / 2 : x;
  const y0 = base === 'middle' ? y - h / 2 : base === 'top' ? y : y - h;
  const t = ctx.getTransform(), dpr = window.devicePixelRatio || 1;
  // inset a pixel: labels that only touch are not drawn over each other
  return {s, pts: [[x0 + 1, y0 + 1], [x0 + w - 1, y0 + 1], [x0 + w - 1, y0 + h - 1], [x0 + 1, y0 + h - 1]]
    .map(([px, py]) => [(t.a * px + t.c * py + t.e) / dpr, (t.b * px + t.d * py + t.f) / dpr])};
}

// convex quadrilaterals overlap unless some edge's normal separates them
function quadsOverlap(p, q) {
  for (const poly of [p, q]) {
    for (let i = 0; i < 4; i++) {
      const [ax, ay] = poly[i], [bx, by] = poly[(i + 1) % 4], nx = by - ay, ny = ax - bx;
      const proj = pts => pts.map(([x, y]) => x * nx + y * ny);
      const a = proj(p), b = proj(q);
      if (Math.max(...a) <= Math.min(...b) || Math.max(...b) <= Math.min(...a)) return false;
    }
  }
  return true;
}

function textProblems(boxes, width, height) {
  const out = [];
  for (const b of boxes) {
    if (b.pts.some(([x, y]) => x < -1 || y < -1 || x > width + 1 || y > height + 1))
      out.push(`"${b.s}" runs past the canvas`);
  }
  for (let i = 0; i < boxes.length; i++) {
    for (let j = i + 1; j < boxes.length; j++) {
      if (quadsOverlap(boxes[i].pts, boxes[j].pts)) out.push(`"${boxes[i].s}" over "${boxes[j].s}"`);
    }
  }
  return out;
}

function writeTextProblems(root, boxes, width, height) {
  const found = textProblems(boxes, width, height);
  root.dataset.overlaps = found.length;
  root.dataset.overlapText = found.slice(0, 3).join(' | ');
}
