"""Completions: a short text that finishes an accepted output from a matcher's position, found by
walking llguidance's own matcher one byte at a time, so the matcher has accepted every byte of
it (a completion is never a guess). ``engine`` keeps one per state for the budget mask.

llguidance 1.9.1 has no "shortest completion" query, so ``complete`` walks: the bytes the grammar
forces (``compute_ff_bytes``) in one go, else one byte by a fixed order of preference. In JSON it
closes what is open (a string, then objects and arrays), and where more is required (a property,
an item, a minimum length) it takes the shortest value; inside a string whose pattern or format
wants particular text it tries the suffixes of an example of each of the schema's patterns and
formats (``hints``). What it finds is not always the shortest text (a string where a number
would be one byte shorter), only a real one: the budget mask is then a little stricter than it
needs to be, never wrong.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass

from .patterns import FORMATS, sre_parse
from .patterns import C as SRE


@dataclass(frozen=True)
class Completion:
    """How an output can finish from a state: ``text``, then EOS."""

    text: bytes
    tokens: int  # tokens that spell ``text`` (greedy longest match), EOS included


MAX_BYTES = 4096  # a walk longer than this gives up: no completion found (the mask refuses)
# JSON outside strings: close what is open, then a separator (a required item or property
# follows), then the shortest value starts
JSON_ORDER = b'}],0123456789"[{tnf-'
TEXT_ORDER = b"a0A "  # inside a JSON string: content bytes tried first
# any other grammar (regexes, Lark, JSON inside Lark, whose strings are not tracked): a quote
# first (it closes a string, or opens one that the next step closes), then JSON_ORDER's others
OTHER_ORDER = b'"' + JSON_ORDER.replace(b'"', b"") + TEXT_ORDER


def complete(
    matcher, eos: int, json_text: bool, hints: tuple[bytes, ...], text: bytes, spelled: frozenset
) -> bytes | None:
    """A text that ``matcher`` (a byte-level matcher at the end of ``text``; consumed by this
    walk, pass a copy) accepts to the end, or None if none was found within MAX_BYTES.
    ``json_text``: the grammar is a JSON Schema's (its strings are tracked to pick bytes);
    ``hints``: texts to try where a string's content is constrained; ``spelled``: the bytes the
    vocabulary has a token for (others are never chosen: no reply can hold them)."""
    out = bytearray()
    in_string, escaped = _string_state(text) if json_text else (False, False)
    closer = ord('"') if json_text else eos  # what a hint must be able to precede
    while len(out) < MAX_BYTES:
        if matcher.is_accepting():
            return bytes(out)
        step = matcher.compute_ff_bytes()
        if not step:
            legal = _legal_bytes(matcher.compute_bitmask()) & spelled
            if not legal:
                return None
            order = (TEXT_ORDER if in_string else JSON_ORDER) if json_text else OTHER_ORDER
            step = _choose(matcher, legal, order, escaped, hints, closer)
        for b in step:
            if b not in spelled or not matcher.consume_token(b):
                return None
            if json_text:
                in_string, escaped = _after(b, in_string, escaped)
        out += step
    return None


def _choose(matcher, legal: set[int], order: bytes, escaped: bool, hints, closer: int) -> bytes:
    """The next bytes: outside a JSON string, by JSON_ORDER; inside one (or in other grammars),
    a closing quote where it is legal, else the shortest hint suffix that ``closer`` (the
    string's quote, or the end of text) can follow, else by ``order``; else the lowest legal."""
    if order is not JSON_ORDER:
        if not escaped and ord('"') in legal:
            return b'"'
        best = None
        for hint in hints:
            for i in range(len(hint)):
                suffix = hint[i:]
                if (best is None or len(suffix) < len(best)) and _precedes(matcher, suffix, closer):
                    best = suffix
        if best is not None:
            return best
    return bytes([next((b for b in order if b in legal), min(legal))])


def _precedes(matcher, data: bytes, closer: int) -> bool:
    """Whether ``data`` then ``closer`` is legal next."""
    return matcher.validate_tokens([*data, closer]) == len(data) + 1


def _legal_bytes(bitmask: bytes) -> set[int]:
    bits = int.from_bytes(bitmask, "little")
    return {b for b in range(256) if bits >> b & 1}


def _string_state(text: bytes) -> tuple[bool, bool]:
    """Whether the JSON text ends inside a string, and just after its backslash."""
    in_string = escaped = False
    for b in text:
        in_string, escaped = _after(b, in_string, escaped)
    return in_string, escaped


def _after(b: int, in_string: bool, escaped: bool) -> tuple[bool, bool]:
    if escaped:
        return True, False
    if in_string:
        return b != ord('"'), b == ord("\\")
    return b == ord('"'), False


def accepts_ending(matcher, data: bytes, eos: int) -> bool:
    """Whether ``data`` then the end of text is legal from ``matcher``'s position (which this
    does not move: llguidance validates without consuming)."""
    ids = [*data, eos]
    done = matcher.validate_tokens(ids)
    if done == len(ids):
        return True
    if done < len(data):
        return False
    copy = matcher.deep_copy()  # a matcher that stops after the last byte refuses a further EOS
    return all(copy.consume_token(b) for b in data) and copy.is_accepting()


# ---------------------------------------------------------------- hints from the grammar text

_JSON_GRAMMAR = "start: %json "
_REGEX_GRAMMAR = re.compile(r"^start: /(.*)/\n", re.S)
_RUST_CODEPOINT = re.compile(r"\\x\{([0-9A-Fa-f]+)\}")


def hints(grammar: str) -> tuple[bytes, ...]:
    """Example texts for the patterns and formats of a schema's grammar (JSON-escaped), or of a
    regex's; none for other grammars. Shortest first."""
    if grammar.startswith(_JSON_GRAMMAR):
        schema, _ = json.JSONDecoder().raw_decode(grammar, len(_JSON_GRAMMAR))
        regexes, escape = list(_schema_regexes(schema)), True
    elif m := _REGEX_GRAMMAR.match(grammar):
        regexes, escape = [m.group(1)], False
    else:
        return ()
    out = set()
    for regex in regexes:
        example = shortest_match(_RUST_CODEPOINT.sub(lambda c: f"\\U{int(c[1], 16):08X}", regex))
        if example:
            text = json.dumps(example, ensure_ascii=False)[1:-1] if escape else example
            out.add(text.encode())
    return tuple(sorted(out, key=lambda h: (len(h), h)))


def _schema_regexes(node):
    if isinstance(node, dict):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("format"), str) and node["format"] in FORMATS:
            yield FORMATS[node["format"]]
        for value in node.values():
            yield from _schema_regexes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_regexes(value)


def shortest_match(regex: str) -> str | None:
    """A short text the regex matches (a hint: checked by the matcher before use), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return _shortest(list(sre_parse.parse(regex)))
    except (re.error, ValueError, RecursionError, OverflowError):
        return None


def _shortest(items) -> str:
    out = []
    for op, av in items:
        if op is SRE.LITERAL:
            out.append(chr(av))
        elif op in (SRE.NOT_LITERAL, SRE.ANY, SRE.IN):
            out.append(_one_char(op, av))
        elif op is SRE.BRANCH:
            out.append(min((_shortest(list(b)) for b in av[1]), key=len))
        elif op is SRE.SUBPATTERN:
            out.append(_shortest(list(av[3])))
        elif op in (SRE.MAX_REPEAT, SRE.MIN_REPEAT, SRE.POSSESSIVE_REPEAT) and av[0]:
            out.append(_shortest(list(av[2])) * av[0])
        elif op is SRE.ATOMIC_GROUP:
            out.append(_shortest(list(av)))
        elif op not in (SRE.AT, SRE.MAX_REPEAT, SRE.MIN_REPEAT, SRE.POSSESSIVE_REPEAT):
            # lookarounds, backreferences: no hint
            raise ValueError(op)
    return "".join(out)


def _one_char(op, av) -> str:
    """A character ``op`` matches: the first of a few plain ones that it does."""
    for c in _PLAIN:
        if (
            op is SRE.ANY
            or (op is SRE.NOT_LITERAL and ord(c) != av)
            or (op is SRE.IN and re.fullmatch(_class_regex(av), c))
        ):
            return c
    raise ValueError("no plain character")


_PLAIN = "a0A_-. " + "".join(map(chr, range(0x21, 0x7F)))


def _class_regex(items) -> str:
    """A Python character class back from its parse (for membership tests of a few chars)."""
    negate = bool(items) and items[0][0] is SRE.NEGATE
    parts = []
    for op, av in items[int(negate) :]:
        if op is SRE.LITERAL:
            parts.append(re.escape(chr(av)))
        elif op is SRE.RANGE:
            parts.append(f"{re.escape(chr(av[0]))}-{re.escape(chr(av[1]))}")
        elif op is SRE.CATEGORY:
            parts.append(_CATEGORY_ESCAPES[av])
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


_CATEGORY_ESCAPES = {
    SRE.CATEGORY_DIGIT: r"\d",
    SRE.CATEGORY_NOT_DIGIT: r"\D",
    SRE.CATEGORY_SPACE: r"\s",
    SRE.CATEGORY_NOT_SPACE: r"\S",
    SRE.CATEGORY_WORD: r"\w",
    SRE.CATEGORY_NOT_WORD: r"\W",
}
