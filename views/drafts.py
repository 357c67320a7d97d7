"""Speculative decoding made visible: the chat's marks on a reply's drafted tokens, and the
Layers tab's view of one rejection (the verify pass's guesses beside the draft).

A verify (engine/spec_decode: DraftVerdict) drafts k tokens after the newest one and keeps the
first `num_accepted`; the target's own token follows them (in place of the first rejected
draft, or a bonus when all were kept). The chat's stream carries each verdict on the first
token it yields, so a reply is marked from its events alone, a few strings per token. The
watched request's trace holds the verdicts beside its logit lens, whose final layer at the
query before a rejected draft is the target's distribution there (the verify pass's own rows,
kept as plain decoding would have them: the introspection contract).
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.probes.trace import LensStep, RequestTrace

Decode = Callable[[Sequence[int]], str]

ACCEPTED = "gb-draft-ok"        # drafted and kept
REJECTED = "gb-draft-no"        # drafted and rejected: never part of the reply (ghosted)
CHOSEN = "gb-draft-fix"         # the target's own token in place of a rejected draft
TITLES = {ACCEPTED: "accepted draft", REJECTED: "rejected draft (not in the reply)",
          CHOSEN: "the model's own token, in place of the rejected draft"}
NGRAM_NOTE = "n-gram lookup: one proposed token, no distribution"

CHAT_HELP = (
    "**What this shows:** with *speculate* on, a cheap proposer (n-gram lookup: the tokens "
    "that followed the latest earlier match in the prompt and reply) drafts a few tokens; "
    "the model checks them all in one forward and keeps those it would have chosen itself, so "
    "the reply is exactly the one plain decoding gives, in fewer steps. "
    f'<span class="{ACCEPTED}">accepted draft</span> · '
    f'<s class="{REJECTED}">rejected draft</s> · '
    f'<span class="{CHOSEN}">the model\'s token instead</span> · the Layers tab opens each '
    "rejection's verify step.")
LAYERS_HELP = (
    "A rejected draft's verify step: the target's top guesses for that token (the logit lens' "
    "last layer at the query before it) beside the draft. A draft is kept when it equals the "
    "token the target samples there (greedy: its top guess); drafts after a rejection were "
    "never checked.")


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def _visible(text: str) -> str:
    """A ghost's line breaks and tabs as signs: a rejected draft never breaks the reply's lines."""
    return text.replace("\n", "⏎").replace("\t", "⇥")


def _mark(cls: str, text: str) -> str:
    tag = "s" if cls == REJECTED else "span"
    return f'<{tag} class="{cls}" title="{TITLES[cls]}">{text}</{tag}>'


class DraftMarkup:
    """One reply as HTML with its drafts marked, grown by each streamed event: O(new text) per
    event (the chat shows `html()` as the reply while it streams)."""

    def __init__(self, decode: Decode, prefix: str = ""):
        """prefix: the reply's text before its first verify (no drafts in it)."""
        self.decode = decode
        self.parts: list[str] = [_esc(prefix)] if prefix else []
        self._accepted_left = 0         # tokens still to come that are accepted drafts
        self._ghost: str | None = None  # rejected drafts, shown before the target's token
        self.num_drafted = self.num_accepted = 0

    def add(self, ev) -> None:
        """One TokenEvent: its text, marked by its role in the verify it belongs to."""
        v = getattr(ev, "draft", None)
        if v is not None:               # the first token a verify yields
            self._flush_ghost()
            a = v.num_accepted
            self._accepted_left = a
            self.num_drafted += len(v.drafted)
            self.num_accepted += a
            rejected = v.drafted[a:]
            if rejected:
                self._ghost = "".join(_mark(REJECTED, _esc(_visible(self.decode([t]))))
                                      for t in rejected)
        text = _esc(ev.text or "")
        if ev.token_id is None:         # a final event's flushed text
            self.parts.append(text)
        elif self._accepted_left > 0:
            self._accepted_left -= 1
            self.parts.append(_mark(ACCEPTED, text) if text else "")
        elif self._ghost is not None:   # the target's token where the first draft failed
            self.parts.append(self._ghost)
            self._ghost = None
            self.parts.append(_mark(CHOSEN, text) if text else "")
        else:
            self.parts.append(text)

    def _flush_ghost(self) -> None:
        """Rejected drafts whose replacement never came (the reply stopped first) stay shown."""
        if self._ghost is not None:
            self.parts.append(self._ghost)
            self._ghost = None

    def html(self) -> str:
        return "".join(self.parts) + (self._ghost or "")


# ---- the Layers tab: one rejection's verify step ----------------------------------------------
@dataclass(frozen=True)
class Rejection:
    """The first rejected draft of one verify."""
    index: int              # the verify's index in trace.drafts
    verdict: object         # spec_decode.DraftVerdict
    position: int           # the rejected draft's position in prompt + reply
    draft: int              # the drafted token there
    chosen: int             # the target's token there
    lens: LensStep | None   # the query at position - 1 (the verify pass's row); None: not kept

    @property
    def query(self) -> int:
        return self.position - 1


def rejections(trace: RequestTrace) -> list[Rejection]:
    """Every verify of the trace that rejected a draft, with the lens step of the query that
    chose in its place (None where the reply ended first: a stop among its accepted drafts)."""
    if not trace.drafts:
        return []
    lens = {st.position: st for st in trace.lens}
    out = []
    for i, v in enumerate(trace.drafts):
        a = v.num_accepted
        if a < len(v.drafted):
            p = v.position + a
            out.append(Rejection(i, v, p, int(v.drafted[a]), int(v.token), lens.get(p - 1)))
    return out


def rejection_choices(rejs: Sequence[Rejection], decode: Decode) -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs for the rejections with a recorded verify row."""
    q = lambda t: repr(decode([t]))     # noqa: E731
    return [(f"token {r.position}: drafted {q(r.draft)}, the model chose {q(r.chosen)}",
             str(r.position)) for r in rejs if r.lens is not None]


def draft_guesses(verdict, j: int) -> tuple[list[int], list[float]] | None:
    """A draft model's top guesses at drafted position j (DraftVerdict's optional
    draft_top_ids / draft_top_probs), or None for a proposer without a distribution."""
    ids = getattr(verdict, "draft_top_ids", None)
    probs = getattr(verdict, "draft_top_probs", None)
    if ids is None or probs is None or j >= len(ids):
        return None
    return [int(t) for t in ids[j]], [float(p) for p in probs[j]]


def _bars(ids: Sequence[int], probs: Sequence[float], decode: Decode, draft: int,
          chosen: int, side: str) -> str:
    rows = []
    for rank, (t, p) in enumerate(zip(ids, probs)):
        tags = ([_mark(CHOSEN, "chosen")] if t == chosen else []) + \
            ([_mark(REJECTED, "draft")] if t == draft else [])
        rows.append(
            f'<tr data-token="{int(t)}"><td class="gb-rej-rank">{rank + 1}</td>'
            f'<td class="gb-rej-tok"><code>{_esc(repr(decode([t])))}</code></td>'
            f'<td class="gb-rej-bar"><div style="width:{100 * float(p):.1f}%"></div></td>'
            f'<td class="gb-rej-p">{float(p):.3f}</td><td>{" ".join(tags)}</td></tr>')
    if draft not in ids:
        low = f"below {min(probs):.3f}" if len(probs) else "unknown"
        rows.append(f'<tr class="gb-rej-absent"><td></td><td><code>'
                    f'{_esc(repr(decode([draft])))}</code></td><td colspan="3">the draft is not '
                    f'in the {side}\'s top {len(ids)} (p {low}) {_mark(REJECTED, "draft")}'
                    f'</td></tr>')
    return f'<table class="gb-rej-table">{"".join(rows)}</table>'


def _layers_table(lens: LensStep, decode: Decode, draft: int) -> str:
    """Each layer's top guess, and the draft's probability where it is in that layer's top-k."""
    rows = []
    for layer in range(lens.top_ids.shape[0]):
        ids, ps = lens.top_ids[layer].tolist(), lens.top_probs[layer].tolist()
        dp = f"{ps[ids.index(draft)]:.3f}" if draft in ids else "-"
        rows.append(f"<tr><td>L{layer}</td><td><code>{_esc(repr(decode([ids[0]])))}</code></td>"
                    f"<td>{ps[0]:.3f}</td><td>{dp}</td></tr>")
    return ('<table class="gb-rej-layers"><tr><th>layer</th><th>top guess</th><th>p</th>'
            f'<th>p(draft)</th></tr>{"".join(rows)}</table>')


def rejection_html(rej: Rejection, decode: Decode) -> str:
    """The verify step of one rejection: the target's guesses at the rejected position (the
    final layer of the lens at the query before it, then every layer's top guess) beside the
    draft's own guesses, or the n-gram note when the proposer had no distribution."""
    v, q = rej.verdict, (lambda t: _esc(repr(decode([t]))))
    a, k = v.num_accepted, len(v.drafted)
    dropped = v.drafted[a + 1:]
    head = (f'<p class="gb-rej-head">Verify {rej.index + 1}: {k} drafted from token '
            f'{v.position}, {a} accepted. At token <b>{rej.position}</b> the draft '
            f'{_mark(REJECTED, q(rej.draft))} was rejected; the model chose '
            f'{_mark(CHOSEN, q(rej.chosen))} (its query: token {rej.query}, where the '
            f'slider now points).'
            + (f" The {len(dropped)} draft{'s' if len(dropped) != 1 else ''} after it "
               f"({', '.join(q(t) for t in dropped)}) were dropped unchecked." if dropped else "")
            + "</p>")
    if rej.lens is None:
        target = ("<p>The reply ended before this verify's row was kept: nothing recorded for "
                  "this position.</p>")
    else:
        top = rej.lens.top_ids[-1].tolist()
        target = (_bars(top, rej.lens.top_probs[-1].tolist(), decode, rej.draft, rej.chosen,
                        "target") +
                  "<details open><summary>through the layers (logit lens)</summary>" +
                  _layers_table(rej.lens, decode, rej.draft) + "</details>")
    guesses = draft_guesses(v, a)
    draft = (_bars(guesses[0], guesses[1], decode, rej.draft, rej.chosen, "draft")
             if guesses is not None else f'<p class="gb-rej-ngram">{NGRAM_NOTE}.</p>')
    return (f'<div class="gb-rej" data-position="{rej.position}">{head}'
            '<div class="gb-rej-cols">'
            f'<div class="gb-rej-col" id="gb-rej-target"><h4>Target (verify pass): top guesses '
            f'for token {rej.position}</h4>{target}</div>'
            f'<div class="gb-rej-col" id="gb-rej-draft"><h4>Draft: what it proposed</h4>'
            f'{draft}</div></div></div>')
