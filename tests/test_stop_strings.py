"""The incremental stop-string matcher (engine/stop_strings.py) against a brute-force
reference on fresh random texts split at random points: where the text stops, and how much of
its end is held back, whatever the chunking; and its per-step cost does not grow with the
number of stop strings."""
from __future__ import annotations

import random

from engine.stop_strings import StopMatcher


def first_stop(text: str, stops) -> int | None:
    """Reference: the start of the stop string that ends first (the longest one there)."""
    for end in range(1, len(text) + 1):
        found = [len(s) for s in stops if s and text[:end].endswith(s)]
        if found:
            return end - max(found)
    return None


def held(text: str, stops) -> int:
    """Reference: the longest end of `text` that is a proper prefix of some stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_matches_the_reference_whatever_the_chunking():
    rng = random.Random()           # fresh every run
    for _ in range(3000):
        stops = tuple("".join(rng.choice("abc") for _ in range(rng.randint(1, 6)))
                      for _ in range(rng.randint(1, 5)))
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 30)))
        m, pos, hit = StopMatcher(stops), 0, None
        while pos < len(text) and hit is None:
            pos = min(len(text), pos + rng.randint(1, 5))
            hit = m.feed(text[:pos])
            if hit is None:
                assert m.held == held(text[:pos], stops), (stops, text[:pos])
        assert hit == first_stop(text, stops), (stops, text)


def test_each_character_is_scanned_once_however_many_stop_strings():
    """A step feeds only the characters it added (the old scan re-read a window of every stop
    string, and each of their prefixes, per token: O(stops x length^2))."""
    rng = random.Random()
    text = "".join(rng.choice("abcdefgh ") for _ in range(2000))
    m = StopMatcher(tuple(f"z{i:04d}" + "q" * 200 for i in range(500)))
    calls = 0

    class Counting:         # the automaton, counting the characters it is fed
        def __init__(self, auto):
            self.auto, self.match, self.depth = auto, auto.match, auto.depth

        def step(self, node, ch):
            nonlocal calls
            calls += 1
            return self.auto.step(node, ch)
    m.auto = Counting(m.auto)
    for i in range(1, len(text) + 1, 4):
        assert m.feed(text[:i]) is None
    m.feed(text)
    assert calls == len(text)
