"""Per-request text lists for the Layers charts, made once per token and kept.

A live Layers tab rebuilds its charts several times a second, each with one label per token of
the context; making those labels anew (`short_text` per token, per chart, per tick) was most of
the tab's Python — Python that shares the GIL with the engine's thread. A token's text never
changes once decoded, so each list grows by the new tokens only.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

from views.figures_common import short_text

_CACHE: OrderedDict[tuple, tuple[int, object, list[str]]] = OrderedDict()
_CACHE_MAX = 256            # (request, kind) lists kept: a few per open reply
_LOCK = threading.Lock()


def derived_texts(request_id: str, kind: str, texts: Sequence[str],
                  make: Callable[[int, str], str]) -> list[str]:
    """[make(i, texts[i]) for i in range(len(texts))], extended from the last call's list for
    the same request and kind. The cache is trusted only while the source's last cached entry
    is the same object (a frozen trace shares its text strings with the engine's)."""
    key = (request_id, kind)
    n = len(texts)
    with _LOCK:                 # pages tick on their own threads
        hit = _CACHE.get(key)
        if hit is not None:
            m, last, out = hit
            if m <= n and (m == 0 or texts[m - 1] is last):
                if m < n:
                    out.extend(make(i, texts[i]) for i in range(m, n))
                    _CACHE[key] = (n, texts[n - 1], out)
                _CACHE.move_to_end(key)
                return out[:n]      # a copy: the cached list keeps growing
        out = [make(i, t) for i, t in enumerate(texts)]
        _CACHE[key] = (n, texts[n - 1] if n else None, out)
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
        return out[:n]


def short_texts(request_id: str, texts: Sequence[str], limit: int = 12) -> list[str]:
    """Axis-label texts of every token (views.figures_common.short_text)."""
    return derived_texts(request_id, f"short{limit}", texts, lambda i, t: short_text(t, limit))


def key_hovers(request_id: str, texts: Sequence[str]) -> list[str]:
    """Hover lines of an attention row's keys."""
    return derived_texts(request_id, "key_hover", texts,
                         lambda i, t: f"key {i} “{short_text(t, 12)}”")


_NUMBERS: list[str] = []


def number_labels(n: int) -> list[str]:
    """["0", "1", ..., str(n - 1)], from one list that only grows."""
    with _LOCK:
        if len(_NUMBERS) < n:
            _NUMBERS.extend(str(i) for i in range(len(_NUMBERS), n))
        return _NUMBERS[:n]
