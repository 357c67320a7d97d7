"""Structured output under speculation: verify row j of a guided request is masked by the
grammar as it stands after the drafts before that row. The matcher is advanced through them,
the row's mask written, and the matcher rolled back: the request's grammar only ever consumes
the tokens the verify keeps (engine_core's per-token postprocessing)."""
from __future__ import annotations

ALL_ALLOWED = 0xFFFFFFFF


class DraftedGrammar:
    """What GrammarMasks.fill takes for one row (like guided.Grammar): the mask after
    `drafts`. A draft the grammar refuses leaves the row all-allowed: its token is never kept,
    since the target (masked) cannot have agreed with that draft."""

    def __init__(self, grammar, drafts):
        self.grammar, self.drafts = grammar, list(drafts)
        self.vocab_size = grammar.vocab_size

    def fill(self, row) -> None:
        if not self.drafts:
            self.grammar.fill(row)
            return
        m = self.grammar.matcher
        if m.is_error():
            row.fill(ALL_ALLOWED)
            return
        n = m.try_consume_tokens(self.drafts)
        try:
            if n < len(self.drafts) or m.is_error():
                row.fill(ALL_ALLOWED)
            else:
                m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        finally:
            if n:
                m.rollback(n)


def verify_grammars(grammar, drafts) -> list:
    """The 1 + k rows' mask sources of a verify entry (all None for an unguided request)."""
    if grammar is None:
        return [None] * (1 + len(drafts))
    return [DraftedGrammar(grammar, drafts[:j]) for j in range(1 + len(drafts))]
