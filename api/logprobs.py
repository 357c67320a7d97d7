"""Token logprobs in OpenAI's two shapes (chat's `content` list, completions' parallel lists),
with each token's exact text and UTF-8 bytes read from the tokenizer's vocabulary."""
from __future__ import annotations

from functools import lru_cache

FLOOR = -9999.0         # OpenAI's stand-in for -inf (JSON has no infinity)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: printable Latin-1 bytes as
    themselves, the other 68 as chr(256 + n) in byte order. char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenStrings:
    """id -> (text, bytes) for logprobs. Byte-level vocabularies (Qwen's) give exact bytes,
    also for a token that ends inside a multi-byte character; an engine without a tokenizer
    names tokens `token_id:N` (vLLM's convention)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        """`as_ids`: every token named `token_id:N` (vLLM's return_tokens_as_token_ids)."""
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.alphabet = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and type(backend.decoder).__name__ == "ByteLevel":
            self.alphabet = _byte_level_alphabet()
        self.lookup = lru_cache(maxsize=1 << 16)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None or self.as_ids:
            s = f"token_id:{token_id}"
            return s, list(s.encode())
        raw = None
        if self.alphabet is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self.alphabet for c in piece):
                raw = bytes(self.alphabet[c] for c in piece)
        if raw is None:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]


def _lp(x: float) -> float:
    return x if x == x and x > FLOOR else FLOOR


def chat_entry(lp, top_n: int, strings: TokenStrings) -> dict:
    """One element of chat's `logprobs.content`."""
    text, raw = strings.lookup(lp.token_id)
    top = []
    for tid, v in list(lp.top.items())[:top_n]:
        t, b = strings.lookup(tid)
        top.append({"token": t, "logprob": _lp(v), "bytes": b})
    return {"token": text, "logprob": _lp(lp.logprob), "bytes": raw, "top_logprobs": top}


def completion_logprobs(lps: list, top_n: int, strings: TokenStrings,
                        offset: int = 0) -> dict:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset (character
    offsets of each token in the returned text, starting at `offset`)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = strings.text(lp.token_id)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        values.append(_lp(lp.logprob))
        tops.append({strings.text(t): _lp(v) for t, v in list(lp.top.items())[:top_n]}
                    if top_n else None)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], lps: list, top_n: int, strings: TokenStrings) -> dict:
    """Completions' `logprobs` for an echoed prompt: the first token has none (null), as
    OpenAI's and vLLM's echo; `lps` is the engine's prompt_logprobs (None first)."""
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for tid, lp in zip(prompt_ids, lps):
        text = strings.text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if lp is None else _lp(lp.logprob))
        tops.append(None if lp is None or not top_n else
                    {strings.text(t): _lp(v) for t, v in list(lp.top.items())[:top_n]})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two completions `logprobs` objects, one after the other (echoed prompt, then reply)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def vllm_prompt_logprobs(lps: list, strings: TokenStrings) -> list:
    """vLLM's `prompt_logprobs`: per prompt token (None first) {token id: {logprob, rank,
    decoded_token}} for the prompt token and the top alternatives."""
    out = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                "decoded_token": strings.text(lp.token_id)}}
        for rank, (tid, v) in enumerate(lp.top.items(), 1):
            d.setdefault(str(tid), {"logprob": _lp(v), "rank": rank,
                                    "decoded_token": strings.text(tid)})
        out.append(d)
    return out
