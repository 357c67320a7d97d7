"""views/drafts.py, the marks of speculative decoding: a streamed reply's accepted drafts,
rejected (ghosted) drafts and the model's token in their place land on the right tokens; a
rejection's verify view marks the chosen and the drafted token among the target's guesses, and
the draft's guesses beside them when the proposer had a distribution."""
from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser

import numpy as np
import pytest

from ui_helpers import make_trace

from engine.probes.trace import LensStep
from engine.spec_decode import DraftVerdict
from views import drafts as D


@dataclass
class Ev:
    token_id: int | None
    text: str
    draft: object = None
    finished: bool = False


class Runs(HTMLParser):
    """(mark class or None, text) for each text run of the markup."""

    def __init__(self):
        super().__init__()
        self.stack: list[str | None] = []
        self.runs: list[tuple[str | None, str]] = []

    def handle_starttag(self, tag, attrs):
        self.stack.append(dict(attrs).get("class"))

    def handle_endtag(self, tag):
        self.stack.pop()

    def handle_data(self, data):
        cls = next((c for c in reversed(self.stack) if c), None)
        if self.runs and self.runs[-1][0] == cls:
            self.runs[-1] = (cls, self.runs[-1][1] + data)
        else:
            self.runs.append((cls, data))


def runs_of(markup: str) -> list[tuple[str | None, str]]:
    p = Runs()
    p.feed(markup)
    return p.runs


def decode(ids):
    return "".join(f"<d{t}>" for t in ids)


def simulate(rng: np.random.Generator, n_verifies: int, k: int = 4, prompt_len: int = 10):
    """Events of a reply with plain tokens and verifies, and the expected (class, text) per
    piece: accepted drafts, the rejected ones ghosted before the target's token, plain text."""
    events, expected = [], []
    pos = prompt_len
    tid = 1000

    def text_of(t):
        return f" w{t}"

    for _ in range(n_verifies):
        for _ in range(int(rng.integers(0, 3))):       # plain decode steps between verifies
            events.append(Ev(tid, text_of(tid)))
            expected.append((None, text_of(tid)))
            tid, pos = tid + 1, pos + 1
        drafted = tuple(int(x) for x in rng.integers(1, 900, int(rng.integers(1, k + 1))))
        a = int(rng.integers(0, len(drafted) + 1))
        v = DraftVerdict(pos, drafted, a, tid + a)
        emitted = list(range(tid, tid + a + 1))
        for j, t in enumerate(emitted):
            events.append(Ev(t, text_of(t), v if j == 0 else None))
            if j < a:
                expected.append((D.ACCEPTED, text_of(t)))
            elif a < len(drafted):
                expected += [(D.REJECTED, decode([d])) for d in drafted[a:]]
                expected.append((D.CHOSEN, text_of(t)))
            else:                       # every draft accepted: the bonus token is plain
                expected.append((None, text_of(t)))
        tid, pos = tid + a + 1, pos + a + 1
    return events, expected


def merge(pieces):
    out = []
    for cls, text in pieces:
        if out and out[-1][0] == cls:
            out[-1] = (cls, out[-1][1] + text)
        else:
            out.append((cls, text))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_each_token_carries_its_verify_role(seed):
    rng = np.random.default_rng(seed)
    events, expected = simulate(rng, int(rng.integers(3, 9)))
    m = D.DraftMarkup(decode)
    for ev in events:
        m.add(ev)
    assert runs_of(m.html()) == merge(expected)
    assert m.num_drafted == sum(len(e.draft.drafted) for e in events if e.draft)
    assert m.num_accepted == sum(e.draft.num_accepted for e in events if e.draft)


def test_the_markup_grows_with_the_stream_and_starts_from_the_text_before():
    rng = np.random.default_rng(7)
    events, expected = simulate(rng, 5)
    m = D.DraftMarkup(decode, prefix="Hi <b>")
    seen = []
    for ev in events:
        m.add(ev)
        seen.append(m.html())
    assert all(b.startswith(a) or D.REJECTED in b for a, b in zip(seen, seen[1:]))
    assert runs_of(m.html()) == merge([(None, "Hi <b>")] + expected)
    assert "<b>" not in m.html()        # the reply's own text is escaped


def test_a_rejected_line_break_shows_as_a_sign():
    m = D.DraftMarkup(lambda ids: "\n" if ids[0] == 6 else "x")
    m.add(Ev(9, " nine", DraftVerdict(20, (6,), 0, 9)))
    assert runs_of(m.html()) == [(D.REJECTED, "⏎"), (D.CHOSEN, " nine")]


def test_rejected_drafts_stay_shown_when_the_reply_stops_before_the_models_token():
    v = DraftVerdict(20, (5, 6, 7), 1, 99)
    m = D.DraftMarkup(decode)
    m.add(Ev(5, " five", v))            # the accepted draft was a stop token: the reply ends
    m.add(Ev(None, "", finished=True))
    assert runs_of(m.html()) == [(D.ACCEPTED, " five"), (D.REJECTED, "<d6><d7>")]


# ---- the Layers tab's rejection view --------------------------------------------------------
def _trace_with_drafts(rng):
    tr = make_trace(rng, num_prompt=6, num_out=12, num_layers=3)
    lens_at = {st.position for st in tr.lens}
    tr.drafts = []
    pos = 7
    while pos < 17:
        k = int(rng.integers(1, 4))
        a = int(rng.integers(0, k + 1))
        tr.drafts.append(DraftVerdict(pos, tuple(int(x) for x in rng.integers(0, 100, k)), a,
                                      int(rng.integers(100))))
        pos += a + 1
    return tr, lens_at


@pytest.mark.parametrize("seed", range(4))
def test_rejections_point_at_the_query_before_each_first_rejected_draft(seed):
    rng = np.random.default_rng(seed)
    tr, lens_at = _trace_with_drafts(rng)
    rejs = D.rejections(tr)
    want = [(i, v.position + v.num_accepted) for i, v in enumerate(tr.drafts)
            if v.num_accepted < len(v.drafted)]
    assert [(r.index, r.position) for r in rejs] == want
    for r in rejs:
        assert r.draft == r.verdict.drafted[r.verdict.num_accepted]
        assert r.chosen == r.verdict.token
        assert (r.lens is not None) == (r.position - 1 in lens_at)
        if r.lens is not None:
            assert r.lens.position == r.position - 1
    labels = D.rejection_choices(rejs, decode)
    assert [v for _, v in labels] == [str(r.position) for r in rejs if r.lens is not None]


def _lens(rng, top_ids, layers=3):
    k = len(top_ids)
    p = -np.sort(-rng.dirichlet(np.ones(k + 2), layers)[:, :k], axis=1).astype(np.float32)
    ids = np.tile(np.asarray(top_ids), (layers, 1))
    return LensStep(40, int(top_ids[0]), ids, p, np.zeros(layers, np.int64), p[:, 0],
                    np.ones(layers, np.float32))


def _marked_rows(page: str, side: str) -> dict[int, set[str]]:
    """token id -> mark classes in that row, for one column of the view."""
    col = re.search(rf'id="gb-rej-{side}">(.*?)</div>(?=<div class="gb-rej-col"|</div></div>$)',
                    page, re.S).group(1)
    out = {}
    for tok, row in re.findall(r'<tr data-token="(\d+)">(.*?)</tr>', col, re.S):
        out[int(tok)] = set(re.findall(r'class="(gb-draft-\w+)"', row))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_view_marks_the_chosen_and_the_drafted_token_among_the_targets_guesses(seed):
    rng = np.random.default_rng(seed)
    top = [int(x) for x in rng.choice(500, 5, replace=False)]
    chosen = top[0]
    draft = top[int(rng.integers(1, 5))] if seed % 2 else 900 + seed    # in the top-5 or not
    v = DraftVerdict(41, (draft, 3), 0, chosen)
    rej = D.rejections(type("T", (), {"drafts": [v], "lens": [_lens(rng, top)]})())[0]
    page = D.rejection_html(rej, decode)
    marks = _marked_rows(page, "target")
    assert set(marks) == set(top)
    for t, cls in marks.items():
        want = ({D.CHOSEN} if t == chosen else set()) | ({D.REJECTED} if t == draft else set())
        assert cls == want, (t, cls)
    assert ("not in the target's top 5" in page) == (draft not in top)
    assert D.NGRAM_NOTE in page
    assert "&lt;d3&gt;" in page         # the draft after the rejected one: dropped unchecked


def test_a_draft_models_guesses_show_beside_the_targets():
    rng = np.random.default_rng(11)
    top = [10, 11, 12, 13, 14]
    dids = ((14, 10, 3), (5, 6, 7))
    dps = ((0.6, 0.3, 0.1), (0.5, 0.3, 0.2))
    v = DraftVerdict(41, (14, 5), 0, 10, draft_top_ids=dids, draft_top_probs=dps)
    rej = D.rejections(type("T", (), {"drafts": [v], "lens": [_lens(rng, top)]})())[0]
    page = D.rejection_html(rej, decode)
    assert D.NGRAM_NOTE not in page
    draft_side = _marked_rows(page, "draft")
    assert draft_side == {14: {D.REJECTED}, 10: {D.CHOSEN}, 3: set()}
    assert D.draft_guesses(v, 1) == ([5, 6, 7], [0.5, 0.3, 0.2])
