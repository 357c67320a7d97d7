"""The vocabulary: how many ids the model knows, the tokenizer's special tokens, text <-> ids,
and how the chat template wraps a conversation before it is tokenized."""
from __future__ import annotations

from dataclasses import dataclass, field

SAMPLE_CONVERSATION = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 47+38?"},
)


@dataclass(frozen=True)
class TokenPiece:
    id: int
    text: str                   # the id decoded on its own
    special: bool = False


@dataclass
class Vocabulary:
    vocab_size: int                             # rows of the embedding (config.vocab_size)
    tokenizer_size: int | None                  # ids the tokenizer can produce; None: no tokenizer
    special: list[TokenPiece] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    chat_messages: list[dict] = field(default_factory=list)
    chat_text: str | None = None                # the template's output for chat_messages
    chat_pieces: list[TokenPiece] = field(default_factory=list)

    @property
    def unused_rows(self) -> int:
        """Embedding rows no tokenizer id reaches (vocabularies are padded for fast matmuls)."""
        return max(self.vocab_size - (self.tokenizer_size or self.vocab_size), 0)


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def tokenize(tokenizer, text: str) -> list[TokenPiece]:
    """text -> its tokens, each with its id and its own text (as the engine encodes prompts:
    no special tokens added)."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: type token ids instead")
    return pieces_of_ids(tokenizer, tokenizer.encode(text, add_special_tokens=False))


def parse_ids(text: str, vocab_size: int) -> list[int]:
    """'12, 7 99' -> [12, 7, 99]; a ValueError that names the bad item otherwise."""
    ids = []
    for item in text.replace(",", " ").split():
        try:
            i = int(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a token id: type integers separated by spaces "
                             "or commas") from None
        if not 0 <= i < vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab_size})")
        ids.append(i)
    return ids


def pieces_of_ids(tokenizer, ids: list[int]) -> list[TokenPiece]:
    special = _special_ids(tokenizer) if tokenizer is not None else set()
    return [TokenPiece(i, tokenizer.decode([i]) if tokenizer is not None else str(i),
                       i in special) for i in ids]


def vocabulary(tokenizer, vocab_size: int, eos_ids) -> Vocabulary:
    v = Vocabulary(vocab_size, len(tokenizer) if tokenizer is not None else None,
                   eos_ids=sorted(int(i) for i in eos_ids or ()))
    if tokenizer is None:
        return v
    v.special = [TokenPiece(i, tokenizer.convert_ids_to_tokens(i), True)
                 for i in sorted(_special_ids(tokenizer))]
    if getattr(tokenizer, "chat_template", None):
        v.chat_messages = [dict(m) for m in SAMPLE_CONVERSATION]
        v.chat_text = tokenizer.apply_chat_template(v.chat_messages, tokenize=False,
                                                    add_generation_prompt=True)
        v.chat_pieces = tokenize(tokenizer, v.chat_text)
    return v
