"""Readable text for one token id: a byte-level token that is only part of a UTF-8 character
decodes on its own to "�"; it is shown as its bytes, `<0xE2><0x80>`, instead."""
from __future__ import annotations

from functools import lru_cache



@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of a byte-level BPE token; None when its piece is not byte-level."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    dec = _byte_decoder()
    if not isinstance(piece, str) or not piece or any(ch not in dec for ch in piece):
        return None
    return bytes(dec[ch] for ch in piece)


def readable(tokenizer, token_id: int, text: str) -> str:
    """`text` (the id decoded alone), or its bytes as <0xNN> where decoding gave "�"."""
    if "\ufffd" not in text or tokenizer is None:
        return text
    raw = token_bytes(tokenizer, token_id)
    if raw is None:
        return text
    try:
        return raw.decode("utf-8")          # a whole character after all
    except UnicodeDecodeError:
        return "".join(f"<0x{b:02X}>" for b in raw)
