"""Tokenizer adapter: the exact bytes each token id contributes to the text.

The automaton works on bytes, so this mapping decides exactness: a token whose bytes are wrong
would let the mask admit text the grammar rejects. Two encodings are supported:
byte-level BPE (GPT-2 style, printable stand-ins for bytes, e.g. ``Ġ`` for space) and
SentencePiece (``▁`` for space, ``<0xNN>`` byte-fallback tokens).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True, eq=False)
class TokenVocabulary:
    """Exact bytes per token id; ``None`` for ids that can never appear in constrained text."""

    token_bytes: tuple[bytes | None, ...]
    eos_id: int
    # SentencePiece's byte-fallback ids (``<0x22>``): the model writes a character with its own
    # piece where one exists (``"``), so drafted text is spelled with those first
    byte_fallback: frozenset[int] = frozenset()

    @cached_property
    def fingerprint(self) -> str:
        """Stable hash of the mapping: part of the compiled constraints' cache key."""
        h = hashlib.sha256(str(self.eos_id).encode())
        for b in self.token_bytes:
            h.update(b"\xff" if b is None else len(b).to_bytes(2, "little") + b)
        return h.hexdigest()[:16]

    @cached_property
    def ids_by_bytes(self) -> dict[bytes, int]:
        """One id per byte string (for spelling drafted text in tokens), EOS excluded; where
        several ids share their bytes, the first that is not a byte-fallback id. (Gemma 3 spells
        `"` as both <0x22> and its own piece; drafts spelled with the first were rejected: 91 of
        the 150 grammar-drafted tokens on 16 held-out requests.)"""
        out: dict[bytes, int] = {}
        for i, b in enumerate(self.token_bytes):
            if b and i != self.eos_id and i not in self.byte_fallback:
                out.setdefault(b, i)
        for i in sorted(self.byte_fallback):  # bytes no other token spells
            if (b := self.token_bytes[i]) and i != self.eos_id:
                out.setdefault(b, i)
        return out

    @cached_property
    def token_lengths(self) -> tuple[int, ...]:
        """Bytes per token id (0 for those that never appear in constrained text)."""
        return tuple(len(b) if b is not None else 0 for b in self.token_bytes)

    @cached_property
    def max_token_bytes(self) -> int:
        return max(len(b) for b in self.ids_by_bytes)

    @cached_property
    def longest_by_start(self) -> dict[bytes, int]:
        """{first two bytes: the longest token starting with them}: spelling text tries only
        lengths some token has there (1 where no token of two bytes or more starts so), not up
        to ``max_token_bytes`` (81 in SmolLM2's vocabulary, for a run of spaces) everywhere."""
        longest: dict[bytes, int] = {}
        for b in self.ids_by_bytes:
            if len(b) >= 2:
                longest[b[:2]] = max(longest.get(b[:2], 0), len(b))
        return longest

    @cached_property
    def missing_bytes(self) -> tuple[int, ...]:
        """The bytes no single token spells (none in a byte-level BPE or a SentencePiece
        vocabulary with byte fallback)."""
        return tuple(b for b in range(256) if bytes([b]) not in self.ids_by_bytes)

    def spelled_length(self, data: bytes) -> int | None:
        """How many tokens spell ``data`` by greedy longest match (None: some byte cannot be
        spelled). Any spelling of text the grammar accepts is legal token by token (the masks
        hold every token whose bytes keep the text a prefix of an accepted one), so this bounds
        the tokens a completion takes."""
        count, pos, table, longest = 0, 0, self.ids_by_bytes, self.longest_by_start
        while pos < len(data):
            for end in range(min(len(data), pos + longest.get(data[pos : pos + 2], 1)), pos, -1):
                if data[pos:end] in table:
                    break
            else:
                return None
            count, pos = count + 1, end
        return count

    def text_bytes(self, ids: list[int]) -> bytes:
        """The bytes of a token sequence; special tokens become NUL, which never matches text."""
        return b"".join(self.token_bytes[i] or b"\x00" for i in ids)

    def output_bytes(self, ids: list[int]) -> bytes:
        """The bytes a token sequence adds to the output (EOS and special tokens add none)."""
        return b"".join(self.token_bytes[i] or b"" for i in ids if i != self.eos_id)

    def decode(self, ids: list[int]) -> str:
        """Text of a token sequence, from the same bytes the automaton saw (EOS contributes none)."""
        return self.output_bytes(ids).decode("utf-8", errors="replace")


def token_vocabulary(tokenizer) -> TokenVocabulary:
    """Map every token id of a transformers tokenizer to its exact bytes."""
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token_id: set tokenizer.eos_token to the "
            "token that ends a reply (e.g. '<|im_end|>' for chat models)."
        )
    decoder = tokenizer.backend_tokenizer.decoder  # its JSON alone (the whole tokenizer's: 0.1 s)
    byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    # ids whose bytes are not their piece's: added tokens are stored as plain text; special ones
    # (chat markers etc.) never appear in constrained text, nor a GGUF file's UNUSED tokens
    # (padding such as Qwen's "[PAD151643]": never text, as in llama.cpp; model.models.
    # load_tokenizer names them)
    added = tokenizer.added_tokens_decoder
    own = {i: None if t.special else t.content.encode() for i, t in added.items()}
    own |= dict.fromkeys(tokenizer.all_special_ids, None)
    own |= dict.fromkeys(getattr(tokenizer, "unused_token_ids", ()), None)
    own = {i: b for i, b in own.items() if isinstance(i, int) and 0 <= i < len(pieces)}
    missing = [i for i, p in enumerate(pieces) if p is None] if None in pieces else []
    plain = list(pieces)  # the pieces read: the others' bytes are set below
    for i in [*own, *missing]:
        plain[i] = ""
    token_bytes = _byte_level_all(plain) if byte_level else _sentencepiece_all(plain)
    for i, b in own.items():
        token_bytes[i] = b
    for i in missing:
        token_bytes[i] = None
    fallback = () if byte_level else (i for i, p in enumerate(plain) if _is_byte_piece(p))
    return TokenVocabulary(tuple(token_bytes), tokenizer.eos_token_id, frozenset(fallback))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, stand-in character → byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for U+0100 on in byte order (``Ġ`` = U+0120 is the space)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_UNICODE_TO_BYTE = _byte_level_alphabet()
_ALPHABET = frozenset(_UNICODE_TO_BYTE)
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _UNICODE_TO_BYTE.items()})


def _byte_level(piece: str) -> bytes | None:
    """The bytes a byte-level piece stands for (49k pieces: C-level set and translate calls,
    five times faster than a per-character loop)."""
    if not _ALPHABET.issuperset(piece):
        return None  # not a byte-level piece (cannot be produced by the pre-tokenizer)
    return piece.translate(_TO_LATIN1).encode("latin-1")


def _byte_level_all(pieces: list[str]) -> list[bytes | None]:
    """_byte_level of each piece, in one comprehension. (Not joined by a separator as
    _sentencepiece_all: the translation makes every byte, NUL included, of some character.)"""
    superset, table = _ALPHABET.issuperset, _TO_LATIN1
    return [p.translate(table).encode("latin-1") if superset(p) else None for p in pieces]


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _sentencepiece(piece: str) -> bytes:
    if _is_byte_piece(piece):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _sentencepiece_all(pieces: list[str]) -> list[bytes]:
    """_sentencepiece of each piece: "▁" → space on all of them at once, joined by NUL, then
    the pieces holding "<0x" (the byte-fallback ones, and any other) one by one (Gemma 3's
    262k: 35 ms; a call per piece took 0.2 s of every load)."""
    text = "\x00".join(pieces)
    if text.count("\x00") != len(pieces) - 1:  # a piece holds NUL (or there are none)
        return [_sentencepiece(p) for p in pieces]
    out = text.replace("\u2581", " ").encode().split(b"\x00")
    i = start = 0
    for found in re.finditer("<0x", text):  # in order: i counts the NULs before it
        i += text.count("\x00", start, found.start())
        start = found.start()
        out[i] = _sentencepiece(pieces[i])
    return out
