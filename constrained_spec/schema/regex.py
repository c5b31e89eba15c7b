"""Regex building blocks for the schema front end: JSON strings (free text, ``pattern``,
``format``) and bounded numbers.

A JSON Schema string keyword constrains the *decoded* string; the automaton sees its JSON text,
where ``"``, ``\\`` and control characters are escaped. So a ``pattern`` is parsed with Python's
own parser (jsonschema checks patterns with ``re.search``) and re-emitted one character at a
time in its JSON form. Where Python's meaning is wider than what we can write down (``\\d``
matches every Unicode digit) the emitted regex takes the ASCII part only: fewer strings, never
more. Features a finite automaton cannot express exactly (lookarounds, backreferences, anchors
inside the pattern, flags) raise ``PatternError`` naming the feature.
"""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal

try:  # Python >= 3.11
    from re import _constants as C
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as C
    import sre_parse

MAX_CODEPOINT = 0x10FFFF
# One character of a JSON string as we write it: the character itself, a short escape, or
# \u00XX for the control characters that have no short escape. Other \uXXXX spellings (and
# surrogate pairs) are valid JSON for the same strings but are never generated: they cost the
# automaton about twice the states per string and the index build time with them.
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u00[01][0-9a-fA-F])'
_META = set("\\.+*?()|[]{}^$#&-~")
_CATEGORY = {
    C.CATEGORY_DIGIT: r"\d",
    C.CATEGORY_NOT_DIGIT: r"\D",
    C.CATEGORY_SPACE: r"\s",
    C.CATEGORY_NOT_SPACE: r"\S",
    C.CATEGORY_WORD: r"\w",
    C.CATEGORY_NOT_WORD: r"\W",
}


class PatternError(ValueError):
    """A pattern (or format) the automaton cannot honour exactly; the message names why."""


def literal(text: str) -> str:
    """``text`` as a regex matching exactly itself (outlines-core / Rust regex syntax)."""
    return "".join("\\" + c if c in _META else c for c in text)


def json_string(value: str) -> str:
    """Regex of the JSON text of ``value`` (quotes included), raw UTF-8 or \\u-escaped."""
    forms = {json.dumps(value, ensure_ascii=False), json.dumps(value)}
    return alternation(sorted(literal(f) for f in forms))


_SHORT_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "\b": "b",
    "\f": "f",
    "\n": "n",
    "\r": "r",
    "\t": "t",
}


def json_string_except(excluded: set[str]) -> str:
    """Regex of the JSON strings (quotes included, spelled as STRING_CHAR spells them) whose
    value is none of ``excluded``: a walk down the trie of the excluded values, leaving it
    at any character it does not continue with."""
    trie: dict = {}
    for value in excluded:
        node = trie
        for ch in value:
            node = node.setdefault(ch, {})
        node[None] = {}  # an excluded value ends here

    def unicode_escape(code: int) -> str:  # \u00XX, hex digits in either case
        return "\\\\u00" + "".join(f"[{h}{h.upper()}]" if h.isalpha() else h for h in f"{code:02x}")

    def spell(ch: str) -> str:  # every spelling STRING_CHAR has for ``ch``
        forms = [literal(ch)] if ch >= " " and ch not in '"\\' else []
        if ch in _SHORT_ESCAPES:
            forms.append("\\\\" + literal(_SHORT_ESCAPES[ch]))
        if ch < " ":
            forms.append(unicode_escape(ord(ch)))
        return alternation(forms)

    def other(children: set[str]) -> str:  # one character (any spelling) not in ``children``
        forms = [
            '[^"\\\\\\x00-\\x1f' + "".join(literal(c) for c in sorted(children) if c >= " ") + "]"
        ]
        short = [literal(e) for c, e in _SHORT_ESCAPES.items() if c not in children]
        if short:
            forms.append("\\\\[" + "".join(short) + "]")
        if any(c < " " for c in children):
            forms += [unicode_escape(i) for i in range(32) if chr(i) not in children]
        else:
            forms.append("\\\\u00[01][0-9a-fA-F]")
        return alternation(forms)

    def walk(node: dict) -> str:
        alts = [] if None in node else ['"']
        alts += [spell(ch) + walk(child) for ch, child in node.items() if ch is not None]
        alts.append(other({ch for ch in node if ch is not None}) + STRING_CHAR + '*"')
        return alternation(alts)

    return '"' + walk(trie)


def alternation(alts: list[str]) -> str:
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def repeat(regex: str, lo: int, hi: int | None) -> str:
    if (lo, hi) == (1, 1):
        return regex
    return f"(?:{regex}){{{lo},{'' if hi is None else hi}}}"


# --- patterns -------------------------------------------------------------------------------


def pattern_body(pattern: str, min_len: int = 0, max_len: int | None = None) -> str:
    """Regex of the JSON-escaped strings (no quotes) in which ``re.search(pattern)`` succeeds
    and whose length is within [min_len, max_len]."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise PatternError(f"{pattern!r} is not a valid regular expression ({e})") from None
    if parsed.state.flags & (re.I | re.M | re.S | re.L | re.A):
        raise PatternError("inline flags such as (?i), (?m), (?s) are not supported")
    branches = _alternatives(list(parsed))
    if (min_len, max_len) != (0, None):
        fitted, error = [], None
        for branch in branches:  # a branch that cannot be fitted is left out (fewer strings)
            try:
                fitted.append(_bounded(list(branch), min_len, max_len))
            except PatternError as e:
                error = e
        if not fitted:
            raise error
        return alternation(fitted)
    return alternation([_anchored(list(b)) for b in branches])


def _alternatives(items: list, limit: int = 256) -> list[list]:
    """The pattern's top-level alternatives as item lists: groups inlined, and alternations
    with anchors multiplied out (sre_parse factors common prefixes such as ^ out of them), so
    that anchors end up at the ends. Left as one alternative past ``limit``."""
    for i, (op, av) in enumerate(items):
        if op is C.SUBPATTERN and not (av[1] or av[2]):
            return _alternatives(items[:i] + list(av[3]) + items[i + 1 :], limit)
        if op is C.BRANCH and any(b and C.AT in (b[0][0], b[-1][0]) for b in map(list, av[1])):
            out = [
                alt
                for b in av[1]
                for alt in _alternatives(items[:i] + list(b) + items[i + 1 :], limit)
            ]
            return out if len(out) <= limit else [items]
    return [items]


def _anchored(items: list) -> str:
    start, end, body = _anchors(items)
    # pattern is unanchored (re.search): anything may come before / after the match
    return ("" if start else f"{STRING_CHAR}*") + _seq(body) + ("" if end else f"{STRING_CHAR}*")


def _anchors(items: list) -> tuple[bool, bool, list]:
    start = bool(items) and items[0] in ((C.AT, C.AT_BEGINNING), (C.AT, C.AT_BEGINNING_STRING))
    end = len(items) > int(start) and items[-1] in ((C.AT, C.AT_END), (C.AT, C.AT_END_STRING))
    return start, end, items[int(start) : len(items) - int(end)]


def _bounded(items: list, min_len: int, max_len: int | None) -> str:
    """Strings of min_len..max_len characters in which the pattern matches. Sound, not exact:
    the match is the whole string, or (if the pattern is not anchored at that end) the string
    starts with it and free characters pad it; the pattern's repeats are narrowed to fit."""
    start, end, body = _anchors(items)
    if start and end:
        return _seq(_fit(body, min_len, max_len))
    body = _fit(body, 0, max_len)
    lo, hi = _width(body)
    pad_lo, pad_hi = max(min_len - lo, 0), None if max_len is None else max_len - hi
    if pad_hi is not None and pad_lo > pad_hi:
        body, pad_lo, pad_hi = _fit(body, min_len, max_len), 0, 0
    pad = repeat(STRING_CHAR, pad_lo, pad_hi) if pad_hi != 0 else ""
    return pad + _seq(body) if end else _seq(body) + pad


def _width(items: list) -> tuple[int, int | None]:
    lo, hi = sre_parse.SubPattern(sre_parse.State(), list(items)).getwidth()
    return lo, None if hi >= C.MAXREPEAT else hi


_CANNOT_FIT = (
    "minLength/maxLength together with this pattern: its repeats cannot be narrowed "
    "to fit; put the length into the pattern (e.g. ^[a-z]{3,8}$)"
)


def _fit(body: list, min_len: int, max_len: int | None) -> list:
    """``body`` with its top-level repeats narrowed so that every match has min_len..max_len
    characters: the spare length above their minimum is shared out, then minimums raised."""
    lo, hi = _width(body)
    if min_len <= lo and (max_len is None or (hi is not None and hi <= max_len)):
        return body
    reps = {
        i: list(av)
        for i, (op, av) in enumerate(body)
        if op in (C.MAX_REPEAT, C.MIN_REPEAT)
        and _width(av[2])[0] >= 1
        and _width(av[2])[1] is not None
    }
    rest = [x for i, x in enumerate(body) if i not in reps]
    rest_lo, rest_hi = _width(rest)
    if max_len is not None:
        spare = (
            None
            if rest_hi is None
            else max_len - rest_hi - sum(r_lo * _width(sub)[1] for r_lo, _, sub in reps.values())
        )
        if spare is None or spare < 0 or not reps:
            raise PatternError(_CANNOT_FIT)
        for r in reps.values():
            r[1] = min(r[1], r[0] + spare // (len(reps) * _width(r[2])[1]))
    need = min_len - rest_lo - sum(r_lo * _width(sub)[0] for r_lo, _, sub in reps.values())
    for r in reps.values():
        step = _width(r[2])[0]
        more = min(r[1] - r[0], -(-max(need, 0) // step))
        r[0], need = r[0] + more, need - more * step
    if need > 0:
        raise PatternError(
            "minLength/maxLength together with this pattern: it cannot be "
            "lengthened to minLength; put the length into the pattern "
            "(e.g. ^[a-z]{3,8}$)"
        )
    fitted = [(C.MAX_REPEAT, tuple(reps[i])) if i in reps else x for i, x in enumerate(body)]
    lo, hi = _width(fitted)
    if lo < min_len or (max_len is not None and (hi is None or hi > max_len)):
        raise PatternError(_CANNOT_FIT)
    return fitted


def _seq(items) -> str:
    return "".join(_item(op, av) for op, av in items)


def _item(op, av) -> str:
    if op is C.LITERAL:
        return literal(json.dumps(chr(av), ensure_ascii=False)[1:-1])
    if op in (C.NOT_LITERAL, C.ANY, C.IN):
        return _charset_regex(_charset(op, av))
    if op in (C.MAX_REPEAT, C.MIN_REPEAT):  # laziness does not change a full-match language
        lo, hi, sub = av
        return repeat(_seq(sub), lo, None if hi >= C.MAXREPEAT else hi)
    if op is C.SUBPATTERN:
        if av[1] or av[2]:
            raise PatternError("scoped inline flags (?i:...) are not supported")
        return "(?:" + _seq(av[3]) + ")"
    if op is C.BRANCH:
        return "(?:" + "|".join(_seq(b) for b in av[1]) + ")"
    names = {
        C.AT: "anchors or \\b inside the pattern (only a leading ^ and a trailing $)",
        C.GROUPREF: "backreferences",
        C.GROUPREF_EXISTS: "conditional groups",
        C.ASSERT: "lookarounds",
        C.ASSERT_NOT: "lookarounds",
    }
    raise PatternError(f"{names.get(op, str(op).lower())} cannot be compiled to an automaton")


def _charset(op, av) -> list[tuple[int, int]]:
    """Code point ranges a one-character item matches (ASCII-only where Python's is wider)."""
    if op is C.ANY:
        return [(0, 9), (11, MAX_CODEPOINT)]
    if op is C.NOT_LITERAL:
        return _complement([(av, av)])
    negate = bool(av) and av[0][0] is C.NEGATE
    ranges, categories = [], []
    for sub_op, sub_av in av[int(negate) :]:
        if sub_op is C.LITERAL:
            ranges.append((sub_av, sub_av))
        elif sub_op is C.RANGE:
            ranges.append(sub_av)
        elif sub_op is C.CATEGORY and sub_av in _CATEGORY:
            categories.append(_CATEGORY[sub_av])
        else:
            raise PatternError(f"character class item {sub_op} is not supported")
    for cat in categories:  # exact on ASCII; non-ASCII members are left out (fewer strings)
        ranges += [(c, c) for c in range(128) if re.fullmatch(cat, chr(c))]
    if not negate:
        return _normalise(ranges)
    full = _complement(ranges)
    return [(lo, min(hi, 127)) for lo, hi in full if lo < 128] if categories else full


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


def _charset_regex(ranges: list[tuple[int, int]]) -> str:
    """The JSON spellings of a set of characters: raw where JSON allows, escaped otherwise."""
    special = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)]
    raw = [r for r in _intersect(ranges, _complement(special))]
    escaped = [c for lo, hi in _intersect(ranges, special[:3]) for c in range(lo, hi + 1)]
    alts = (
        [
            "["
            + "".join(f"\\x{{{lo:X}}}" + (f"-\\x{{{hi:X}}}" if hi > lo else "") for lo, hi in raw)
            + "]"
        ]
        if raw
        else []
    )
    alts += [literal(json.dumps(chr(c))[1:-1]) for c in escaped]
    if not alts:
        raise PatternError("a character class that matches no character")
    return alternation(alts)


def _intersect(a, b) -> list[tuple[int, int]]:
    return [
        (max(x, y), min(p, q))
        for x, p in _normalise(a)
        for y, q in _normalise(b)
        if max(x, y) <= min(p, q)
    ]


# --- formats --------------------------------------------------------------------------------
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


def format_body(name: str, min_len: int = 0, max_len: int | None = None) -> str:
    """Regex of the JSON text (no quotes) of strings in format ``name`` (a key of FORMATS)."""
    return pattern_body(f"^{FORMATS[name]}$", min_len, max_len)


# --- numbers --------------------------------------------------------------------------------
# Integers: exact digit-range regexes. Non-integers with bounds: at most FRACTION_DIGITS digits
# after the point and no exponent, so that json.loads' float rounding (~1e-7 at 1e9) cannot move
# a value across a bound (values are >= 1e-6 away from it, or exactly on it).
FRACTION_DIGITS = 6


def integer_range(lo: int | None, hi: int | None) -> str | None:
    """Regex of the canonical decimal integers in [lo, hi] (None: unbounded); None if empty."""
    alts = []
    if hi is None or hi >= 0:
        alts += _naturals(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:
        mags = _naturals(
            max(-hi, 1) if hi is not None and hi < 0 else 1, -lo if lo is not None else None
        )
        if mags:
            alts.append("-" + alternation(mags))
    return alternation(alts) if alts else None


def _naturals(lo: int, hi: int | None) -> list[str]:
    if hi is not None and lo > hi:
        return []
    alts, n = [], len(str(lo))
    while hi is None or n <= len(str(hi)):
        first, last = max(lo, 10 ** (n - 1) if n > 1 else 0), 10**n - 1
        if hi is None and lo <= 10 ** (n - 1) and n > 1:
            return alts + [f"[1-9][0-9]{{{n - 1},}}"]  # every length from here on
        last = last if hi is None else min(last, hi)
        if first <= last:
            alts.append(_same_length(str(first), str(last)))
        n += 1
    return alts


def _same_length(a: str, b: str) -> str:
    """Digit strings of one length between a and b (inclusive)."""
    if a == b:
        return a
    if a[0] == b[0]:
        return a[0] + _same_length(a[1:], b[1:])
    n = len(a) - 1
    tail = f"[0-9]{{{n}}}" if n else ""
    if a[1:] == "0" * n and b[1:] == "9" * n:
        return f"[{a[0]}-{b[0]}]" + tail
    alts = [a[0] + _same_length(a[1:], "9" * n)]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        alts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + tail)
    alts.append(b[0] + _same_length("0" * n, b[1:]))
    return "(?:" + "|".join(alts) + ")"


def number_range(lo, lo_ex: bool, hi, hi_ex: bool) -> str | None:
    """Regex of decimal numbers x with lo <(=) x <(=) hi (int or float bounds, compared as the
    shortest decimal that reads back as the same float; None: unbounded)."""
    lo = None if lo is None else Decimal(repr(lo))
    hi = None if hi is None else Decimal(repr(hi))
    alts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_ex):  # x >= 0
        pos_lo, pos_ex = (lo, lo_ex) if lo is not None and lo >= 0 else (Decimal(0), False)
        alts += _magnitudes(pos_lo, pos_ex, hi, hi_ex)
    if lo is None or lo < 0:  # x < 0, as m = -x > 0
        neg_lo, neg_ex = (-hi, hi_ex) if hi is not None and hi < 0 else (Decimal(0), True)
        mags = _magnitudes(neg_lo, neg_ex, None if lo is None else -lo, lo_ex)
        if mags:
            alts.append("-" + alternation(mags))
    return alternation(alts) if alts else None


def _magnitudes(lo: Decimal, lo_ex: bool, hi: Decimal | None, hi_ex: bool) -> list[str]:
    """Unsigned decimals m with lo <(=) m <(=) hi, as integer part + fraction: any fraction
    strictly between the bounds' integer parts, a bounded fraction on them."""
    a, fa = _split(lo)
    b, fb = (None, None) if hi is None else _split(hi)
    if b is not None and b < a:
        return []
    alts = []
    if b is None or a + 1 <= b - 1:
        whole = integer_range(a + 1, None if b is None else b - 1)
        alts.append(whole + _fraction("", False, None, False))
    on_a = _fraction(fa, lo_ex, fb if b == a else None, hi_ex and b == a)
    if on_a is not None:
        alts.append(f"{a}{on_a}")
    on_b = None if b is None or b == a else _fraction("", False, fb, hi_ex)
    if on_b is not None:
        alts.append(f"{b}{on_b}")
    return alts


def _split(d: Decimal) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a non-negative decimal."""
    whole, _, frac = f"{d:f}".partition(".")
    return int(whole), frac.rstrip("0")


def _fraction(lo: str, lo_ex: bool, hi: str | None, hi_ex: bool) -> str | None:
    """Regex of the optional ".digits" whose value f satisfies 0.lo <(=) f <(=) 0.hi (hi None:
    below 1); None if no fraction fits."""
    digits = _digits(lo, lo_ex, hi, hi_ex, FRACTION_DIGITS)
    bare = _zero_fits(lo, lo_ex, hi, hi_ex)  # no fraction at all means f = 0
    if digits is None:
        return "" if bare else None
    return f"(?:\\.{digits})?" if bare else f"\\.{digits}"


def _zero_fits(lo: str, lo_ex: bool, hi: str | None, hi_ex: bool) -> bool:
    return lo == "" and not lo_ex and (hi is None or hi != "" or not hi_ex)


@functools.lru_cache(maxsize=4096)
def _digits(lo: str, lo_ex: bool, hi: str | None, hi_ex: bool, n: int) -> str | None:
    """Regex of 1..n digits d1 d2 ... whose value 0.d1d2... lies within (lo, hi) as in
    _fraction, built digit by digit: only digits equal to a bound's digit carry a bound on."""
    if n == 0:
        return None
    if (lo, lo_ex, hi) == ("", False, None):
        return f"[0-9]{{1,{n}}}"
    tails: dict[str, list[int]] = {}
    for d in range(int(lo[:1] or 0), (int(hi[:1] or 0) if hi is not None else 9) + 1):
        sub_lo = (lo[1:], lo_ex) if lo and d == int(lo[0]) else ("", lo_ex and not lo and d == 0)
        sub_hi = (hi[1:], hi_ex) if hi is not None and d == int(hi[:1] or 0) else (None, False)
        rest, stop = _digits(*sub_lo, *sub_hi, n - 1), _zero_fits(*sub_lo, *sub_hi)
        if rest is not None or stop:
            tail = "" if rest is None else (f"(?:{rest})?" if stop else rest)
            tails.setdefault(tail, []).append(d)
    alts = [
        (
            str(ds[0])
            if len(ds) == 1
            else f"[{ds[0]}-{ds[-1]}]"
            if ds[-1] - ds[0] == len(ds) - 1
            else f"[{''.join(map(str, ds))}]"
        )
        + tail
        for tail, ds in tails.items()
    ]
    return alternation(alts) if alts else None
