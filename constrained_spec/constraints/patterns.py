"""Regexes in llguidance's terms: a JSON Schema ``pattern`` (Python's ``re`` meaning, which
jsonschema checks with ``re.search``) rewritten in llguidance's Rust syntax to match what Python
matches, or less; and the formats jsonschema checks, written as such patterns."""

from __future__ import annotations

import re
import warnings
from functools import cache

from ..errors import UnsupportedSchemaError

try:  # Python >= 3.11
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as C
    import sre_parse

MAX_CODEPOINT = 0x10FFFF


class PatternError(ValueError):
    """A pattern llguidance cannot be told exactly; the message names the feature."""


# Formats: each a Python pattern, anchored, whose every match passes jsonschema's FormatChecker
# (and the stricter libraries it may use: rfc3339-validator, idna, fqdn, rfc3987); many valid
# values are left out (e.g. IPv6 shorthand), never an invalid one is let in.
# Each is a Python pattern, anchored, whose every match passes jsonschema's FormatChecker
# (and the stricter libraries it may use: rfc3339-validator, idna, fqdn, rfc3987); many valid
# values are left out (e.g. IPv6 shorthand), never an invalid one is let in.
_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0000 is not a date
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z](?:[a-z0-9]|-[a-z0-9]){0,30}"  # <= 61 chars, no "--" (idna), no edge hyphen
_HOST = rf"{_LABEL}(?:\.{_LABEL}){{0,3}}"  # <= 247 chars in all (fqdn: 253)
_URI = rf"https?://{_HOST}(?::[1-9][0-9]{{0,3}})?(?:/[a-zA-Z0-9._~-]*)*(?:\?[a-zA-Z0-9._~=&-]*)?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}T{_TIME}",
    "email": r"[a-zA-Z0-9._%+-]{1,64}@[a-z0-9](?:[a-z0-9-]{0,30}[a-z0-9])?(?:\.[a-z]{2,10}){1,3}",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    "ipv6": r"[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){7}",
    "hostname": _HOST,
    "uri": _URI,
    "json-pointer": r"(?:/(?:[^~/]|~[01])*)*",
}
FORMATS |= {
    "idn-email": FORMATS["email"],
    "idn-hostname": _HOST,
    "uri-reference": _URI,
    "iri": _URI,
    "iri-reference": _URI,
    "ip-address": FORMATS["ipv4"],
    "host-name": _HOST,
}
# Formats JSON Schema defines (some checked by jsonschema when a library is installed) that we
# cannot write as a regex exactly: refused by name. Other format names are annotations only
# (jsonschema ignores them), so they do not constrain the output.
KNOWN_FORMATS = set(FORMATS) | {
    "duration",
    "uri-template",
    "relative-json-pointer",
    "regex",
    "color",
}


def rust_pattern(pattern: str, pointer: str) -> str:
    """``pattern`` in llguidance's (Rust) regex syntax, matching what Python's ``re.search``
    (jsonschema's) matches, or less: written from Python's own parse, every character class as
    explicit ranges, since llguidance's differ from Python's: its negated classes let ``"`` and
    ``\\`` through (``[^"]`` matched ``a"b``), its ``\\s`` lacks \\x1c-\\x1f (so ``\\S`` has
    them), its ``\\w`` and ``\\d`` are ASCII (so ``\\W`` had ``é``), ``[[:alpha:]]`` is a
    POSIX class there and literal characters in Python."""
    try:
        with warnings.catch_warnings():  # "possible nested set": Python reads [[ literally
            warnings.simplefilter("ignore", FutureWarning)
            parsed = sre_parse.parse(pattern)
        if parsed.state.flags & (re.I | re.M | re.L):
            raise PatternError("the flags (?i), (?m) and (?L)")
        return _rust(list(parsed), bool(parsed.state.flags & re.S))
    except (re.error, PatternError, RecursionError) as e:
        raise UnsupportedSchemaError(
            "pattern", pointer, f"{pattern[:200]!r}: {e} (not said in llguidance's terms)."
        ) from None


def _rust(items: list, dotall: bool) -> str:
    return "".join(_rust_item(op, av, dotall) for op, av in items)


def _rust_item(op, av, dotall: bool) -> str:
    if op is C.LITERAL:
        return _rust_class([(av, av)])
    if op is C.NOT_LITERAL:
        return _rust_class(_complement([(av, av)]))
    if op is C.ANY:  # all but a newline, without (?s)
        return _rust_class([(0, MAX_CODEPOINT)] if dotall else _complement([(10, 10)]))
    if op is C.IN:
        return _rust_class(_class_ranges(av))
    if op is C.BRANCH:
        return "(?:" + "|".join(_rust(list(b), dotall) for b in av[1]) + ")"
    if op is C.SUBPATTERN:
        if (av[1] | av[2]) & (re.I | re.M | re.L):
            raise PatternError("the flags (?i), (?m) and (?L)")
        dotall = (dotall or bool(av[1] & re.S)) and not av[2] & re.S
        return "(?:" + _rust(list(av[3]), dotall) + ")"
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # laziness does not change what re.search finds
        lo, hi, sub = av
        return "(?:" + _rust(list(sub), dotall) + f"){{{lo},{'' if hi >= C.MAXREPEAT else hi}}}"
    if op is C.AT and av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING):
        return "^"
    if op is C.AT and av in (C.AT_END, C.AT_END_STRING):  # Python's $ also before a last \n
        return "$"
    raise PatternError(f"{_UNSAID.get(op, 'anchors other than ^ and $')} cannot be said there")


_UNSAID = {
    C.ASSERT: "lookarounds",
    C.ASSERT_NOT: "lookarounds",
    C.GROUPREF: "backreferences",
    C.GROUPREF_EXISTS: "conditional groups",
    C.POSSESSIVE_REPEAT: "possessive repeats",
    C.ATOMIC_GROUP: "atomic groups",
}


def _class_ranges(items) -> list[tuple[int, int]]:
    """Code point ranges of a Python character class (or fewer): \\s as Python's own, \\d and
    \\w their ASCII members (Python's are thousands of ranges, which slowed llguidance's
    compile 20-fold), and a class that complements those cut to ASCII, which it then holds."""
    negate = bool(items) and items[0][0] is C.NEGATE
    ranges, cut = [], False
    for op, av in items[int(negate) :]:
        if op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY and av in _CATEGORIES:
            name, inverted = _CATEGORIES[av]
            members = _category(name)
            ranges += _complement(members) if inverted else members
            cut |= name != "\\s" and (inverted or negate)
        else:
            raise PatternError(f"the class item {str(op).lower()}")
    ranges = _complement(ranges) if negate else _normalise(ranges)
    return _intersect(ranges, [(0, 127)]) if cut else ranges


_CATEGORIES = {
    C.CATEGORY_DIGIT: ("\\d", False),
    C.CATEGORY_NOT_DIGIT: ("\\d", True),
    C.CATEGORY_SPACE: ("\\s", False),
    C.CATEGORY_NOT_SPACE: ("\\s", True),
    C.CATEGORY_WORD: ("\\w", False),
    C.CATEGORY_NOT_WORD: ("\\w", True),
}


@cache
def _category(name: str) -> list[tuple[int, int]]:
    """The code points Python's ``name`` matches: all of them for \\s (~0.1 s, once), the
    ASCII ones for \\d and \\w."""
    top = MAX_CODEPOINT if name == "\\s" else 127
    chars = "".join(map(chr, range(top + 1)))
    return [(m.start(), m.end() - 1) for m in re.finditer(name + "+", chars)]


def _rust_class(ranges) -> str:
    """One character of ``ranges``, every code point written as \\x{...}, in a positive
    class (llguidance's negated ones let ``"`` and ``\\\\`` through), without surrogates (no
    text holds them) and without NUL: a set with all 32 control characters made llguidance
    accept any JSON escape, ``\\"`` and ``\\\\`` too, whether they were members or not."""
    ranges = _intersect(ranges, _complement([(0, 0), (0xD800, 0xDFFF)]))
    if not ranges:
        raise PatternError("a character class that matches no character")
    if ranges == [(ranges[0][0], ranges[0][0])]:
        c = ranges[0][0]
        return chr(c) if chr(c).isascii() and chr(c).isalnum() else f"\\x{{{c:X}}}"
    body = "".join(f"\\x{{{lo:X}}}" + (f"-\\x{{{hi:X}}}" if hi > lo else "") for lo, hi in ranges)
    return f"[{body}]"


def _normalise(ranges) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges) -> list[tuple[int, int]]:
    out, nxt = [], 0
    for lo, hi in _normalise(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    return out + ([(nxt, MAX_CODEPOINT)] if nxt <= MAX_CODEPOINT else [])


def _intersect(a, b) -> list[tuple[int, int]]:
    return [
        (max(x, y), min(p, q))
        for x, p in _normalise(a)
        for y, q in _normalise(b)
        if max(x, y) <= min(p, q)
    ]
