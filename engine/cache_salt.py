"""The root of a request's prefix-cache chain: who may share whose cached prompt blocks.

A request whose forward differs (interventions: interventions/spec.cache_salt) roots its block
hash chain elsewhere, so it never reuses blocks computed by another forward. vLLM's
`cache_salt` does the same for users: requests salted differently never share blocks, so nobody
learns from a faster first token that someone sent the same prompt (the prefix cache's timing
side channel). Both salts combine into one root.
"""
from __future__ import annotations

import hashlib

from .errors import InvalidArgumentError

MAX_SALT_CHARS = 1024


def check_salt(salt) -> str | None:
    """None, or a non-empty string of at most MAX_SALT_CHARS characters (vLLM's rule)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS:
        raise InvalidArgumentError(f"cache_salt must be a non-empty string of at most "
                                   f"{MAX_SALT_CHARS} characters, got {salt!r:.80}", "cache_salt")
    return salt


def _digest63(*parts: bytes) -> int:
    """A stable 63-bit digest (the same in every process, never negative)."""
    return int.from_bytes(hashlib.blake2b(b"".join(parts), digest_size=8).digest(), "little") >> 1


def salt_tag(salt: str | None) -> int | None:
    """Who may read a salted block's text (the KV tab): a digest of the salt alone, so the
    session or key that sent it can be matched without keeping the salt (None: unsalted)."""
    if salt is None:
        return None
    return _digest63(b"glassbox-salt-tag", salt.encode("utf-8", "surrogatepass"))


def chain_root(interventions_salt: int | None, salt: str | None) -> int | None:
    """The chain's root for a request (None: a plain request's). A stable 63-bit digest, so it
    never collides with the plain root by construction and is the same in every process."""
    if salt is None:
        return interventions_salt
    return _digest63(b"glassbox-cache-salt", (interventions_salt or 0).to_bytes(8, "little"),
                     salt.encode("utf-8", "surrogatepass"))
