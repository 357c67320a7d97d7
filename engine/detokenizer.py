"""Incremental detokenization and stop strings. Text is emitted only once it is final: a
trailing piece that could still start a stop string is held back, so stop strings never
reach the user, not even for one event (unless the request asks for them: vLLM's
include_stop_str_in_output ends the text with the stop string)."""
from __future__ import annotations

from .stop_strings import StopMatcher


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...], include_stop: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop    # vLLM's include_stop_str_in_output
        self._decode_kw = {"skip_special_tokens": skip_special_tokens}
        if not spaces_between_special_tokens:   # (a slow tokenizer's option; fast ones ignore it)
            self._decode_kw["spaces_between_special_tokens"] = False
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""          # decoded output so far (before stop truncation)
        self.emitted = 0        # characters of self.text already handed out
        self.stopped = False
        # incremental: each step scans only the characters it added (engine/stop_strings.py)
        self.matcher = StopMatcher(stop) if stop else None

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, **self._decode_kw)

    def add(self, token_ids: list[int], start: int = 0, end: int | None = None) -> None:
        """Decode what the output (token_ids[start:end]) gained since the last call, reading
        only the tail window (byte-level BPE safe: a token that ends inside a multi-byte
        character waits for the next one). `end` excludes tokens still pending on the device."""
        if self.tokenizer is None or self.stopped:
            return
        end = len(token_ids) if end is None else end
        before = self._decode(token_ids[start + self.prefix_offset:start + self.read_offset])
        after = self._decode(token_ids[start + self.prefix_offset:end])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, end - start
        if self.matcher is not None:
            hit = self.matcher.feed(self.text)
            if hit is not None:
                self.text = self.text[:self.matcher.end if self.include_stop else hit]
                self.stopped = True

    def flush_final(self, output_ids: list[int]) -> None:
        if self.tokenizer is not None and not self.stopped:
            self.text = self._decode(output_ids)

    def take(self, final: bool) -> str:
        """New text safe to emit now."""
        end = len(self.text)
        if not final and self.matcher is not None and not self.stopped:
            # hold back a suffix that is a prefix of some stop string
            end = max(self.emitted, end - self.matcher.held)
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta
