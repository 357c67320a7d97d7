// The guided first run (views/tour.py writes the steps): a card in the window's corner and an
// outline on what it points at. It blocks nothing (the page stays usable under it), shows once
// per browser (localStorage), and "Skip tour" or the last "Done" ends it for good. Runs as a
// gr.HTML js_on_load (`element` and `props` are Gradio's).
const cfg = JSON.parse(props.value || '{}');
const steps = cfg.steps || [];
let at = -1, card = null, marked = null;

function visible(sel) {
  const e = sel && document.querySelector(sel);
  if (!e) return null;
  const r = e.getBoundingClientRect();
  return r.width > 0 && r.height > 0 ? e : null;
}

// wait (up to `ms`) for an element to show: a tab's contents appear a moment after its button
async function shown(sel, ms = 8000) {
  for (let t = 0; t < ms; t += 100) {
    const e = visible(sel);
    if (e) return e;
    await new Promise(r => setTimeout(r, 100));
  }
  return null;
}

function unmark() {
  if (marked) marked.classList.remove('gb-tour-target');
  marked = null;
}

function end() {
  localStorage.setItem(cfg.key, '1');
  unmark();
  if (card) card.remove();
  card = null;
  document.body.dataset.tour = 'done';
}

async function go(k) {
  at = k;
  const s = steps[k];
  unmark();
  const tab = document.getElementById(`tab-${s.tab}-button`);
  if (tab && tab.getAttribute('aria-selected') !== 'true') tab.click();
  if (s.open && !visible(s.opened)) {              // an accordion: open it once
    const head = await shown(`${s.open} > button`);
    if (head) head.click();
  }
  card.querySelector('.gb-tour-text').textContent = s.text;
  card.querySelector('.gb-tour-count').textContent = `${k + 1} / ${steps.length}`;
  card.querySelector('.gb-tour-next').textContent = k === steps.length - 1 ? 'Done' : 'Next';
  document.body.dataset.tour = String(k);
  const target = await shown(s.target);
  if (at !== k || !target) return;                 // moved on meanwhile, or nothing to show
  target.classList.add('gb-tour-target');
  target.scrollIntoView({behavior: 'smooth', block: 'center'});
  marked = target;
}

async function next() {
  const s = steps[at];
  const press = s && s.click && await shown(s.click, 1500);
  if (press) press.click();                        // done for the reader: send, try
  if (at + 1 >= steps.length) { end(); return; }
  // the example's reply has to exist before its blocks and layers can be shown
  if (press && s.tab === 'chat') await new Promise(r => setTimeout(r, 1500));
  go(at + 1);
}

if (steps.length && localStorage.getItem(cfg.key) !== '1') {
  card = document.createElement('div');
  card.className = 'gb-tour-card';
  card.id = 'gb-tour-card';
  card.innerHTML = '<div class="gb-tour-head">Guided tour <span class="gb-tour-count"></span></div>' +
    '<div class="gb-tour-text"></div><div class="gb-tour-buttons">' +
    '<button class="gb-tour-skip" type="button">Skip tour</button>' +
    '<button class="gb-tour-next" type="button">Next</button></div>';
  document.body.appendChild(card);                 // fixed in the corner, over no tab's layout
  card.querySelector('.gb-tour-skip').addEventListener('click', end);
  card.querySelector('.gb-tour-next').addEventListener('click', next);
  go(0);
}
