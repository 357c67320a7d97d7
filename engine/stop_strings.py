"""Stop strings matched incrementally: an Aho-Corasick automaton over every stop string of a
request, fed only the characters each step adds, so a step costs O(new characters) (a per-step
`find` of every stop string cost O(stops x length^2) a token: 10,000 stop strings made every
other stream 3x slower). The automaton's state is the longest suffix of the text that is a
prefix of some stop string: exactly the characters to hold back. The first position where any
stop string ends stops the text, the longest there winning, however the text was tokenized.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """The immutable automaton of a tuple of stop strings (built once, shared by requests)."""

    __slots__ = ("goto", "fail", "depth", "match")

    def __init__(self, stops: tuple[str, ...]):
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        match = [0]             # length of the longest stop string ending at this node, or 0
        for s in stops:
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    match.append(0)
                node = nxt
            if s:
                match[node] = max(match[node], len(s))
        fail = [0] * len(goto)
        todo = deque(goto[0].values())
        while todo:                             # breadth first: a node's fail is shallower
            node = todo.popleft()
            for ch, nxt in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0) if goto[f].get(ch, 0) != nxt else 0
                # a stop string ending at a suffix of this node ends here too
                match[nxt] = max(match[nxt], match[fail[nxt]])
                todo.append(nxt)
        self.goto, self.fail, self.depth, self.match = goto, fail, depth, match

    def step(self, node: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[node].get(ch)
            if nxt is not None:
                return nxt
            if node == 0:
                return 0
            node = fail[node]


@lru_cache(maxsize=64)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, cached: building it happens once per distinct tuple, and
    `Sequence` builds it when the request is prepared (off the engine thread)."""
    return StopAutomaton(stops)


class StopMatcher:
    """One request's scan position in its automaton."""

    __slots__ = ("auto", "node", "scanned", "end")

    def __init__(self, stops: tuple[str, ...]):
        self.auto = compile_stops(tuple(stops))
        self.node = 0
        self.scanned = 0        # characters of the text fed so far
        self.end: int | None = None     # where the stop string found ends (after feed hit)

    def feed(self, text: str) -> int | None:
        """Scan text[scanned:]; the index where the first stop string found starts, or None."""
        auto, node = self.auto, self.node
        match = auto.match
        for i in range(self.scanned, len(text)):
            node = auto.step(node, text[i])
            if match[node]:
                self.node, self.scanned, self.end = node, i + 1, i + 1
                return i + 1 - match[node]
        self.node, self.scanned = node, len(text)
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the scanned text that may still start a stop string."""
        return self.auto.depth[self.node]
