"""The constraint engine backed by llguidance: JSON Schema, regex and Lark/GBNF grammars compiled
in milliseconds, masks computed per state by its Earley parser over the same exact token bytes.

Same contract as compile.Constraint (int states, ``step``, ``mask``, ``forced``, ...), so the
decode loop and the drafters do not know which engine they run. llguidance's cursor (an
``LLMatcher``) is stateful; the int states are not: state s names a token path from the start
(a trie of (parent state, token)), and ``_goto`` is the one place that moves the matcher onto a
path: it copies the matcher of the nearest state on that path it has a snapshot of (a copy costs
~2 µs) and consumes the rest, never calling llguidance's rollback: after rollbacks with masks
computed along the way, llguidance 1.9.1 returned a mask allowing a token that a fresh matcher on
the same path refuses (tests/test_guidance.py replays such a sequence). Stepping never moves the
matcher (a step is legal iff the parent's mask allows the token), so exploring a draft costs one
mask per new state, and rolling back to the committed prefix is keeping the old int.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections import OrderedDict
from functools import cache

import llguidance as llg
import numpy as np
import torch

from .compile import FINISHED, Constraint
from .errors import ConstraintError, UnsupportedSchemaError
from .vocab import TokenVocabulary

MASK_CACHE = 256  # masks kept per constraint (LRU): a 49k vocabulary's bool mask is 49 kB
SNAPSHOTS = 256  # matcher copies kept per constraint (LRU), one per state whose mask was computed
COMPILED_CACHE = 32  # constraints kept in memory (LRU), by grammar × vocabulary
# The trie of states grows with every token path asked about (~100 bytes a state); past this many
# states, compile_grammar hands later requests a fresh constraint (3 ms) instead of the cached one,
# whose states stay valid for the requests still holding it.
MAX_STATES = 1_000_000


class GuidanceConstraint(Constraint):
    """A compiled llguidance grammar over a token vocabulary, with int states (see module doc).
    It subclasses Constraint for the engine-independent queries (``legal_prefix``,
    ``tokenize``, ``accepts_tokens``, ``accepts``), which only use ``step`` and ``accepting``."""

    def __init__(self, grammar: str, vocab: TokenVocabulary, vocab_size: int, source: str):
        self.vocab, self.vocab_size, self.eos_id = vocab, vocab_size, vocab.eos_id
        self.source = source  # what was compiled: "schema", "regex" or "grammar"
        root = llg.LLMatcher(_ll_tokenizer(vocab), grammar, log_level=0)
        if root.is_error():
            raise ConstraintError(f"cannot compile {source}: {root.get_error()}")
        self._root, self._matcher, self._at = root, root.deep_copy(), 0  # _at: _matcher's state
        self._snapshots: OrderedDict[int, llg.LLMatcher] = OrderedDict()
        self.initial_state = 0
        self._parent, self._token, self._depth = [-1], [-1], [0]  # the trie, by state
        self._children: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()  # one matcher, shared by the requests using this constraint
        self._legal_masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._masks: OrderedDict[tuple[int, torch.device], torch.Tensor] = OrderedDict()
        self._accepting: dict[int, bool] = {}
        self._byte_ids, self._plain = _vocab_tables(vocab)

    def _goto(self, state: int) -> None:
        """Put the matcher on ``state``'s path (callers hold the lock): from the matcher where it
        is, if ``state`` lies ahead of it, else from a copy of the nearest snapshot (or the root)
        on that path; then consume the tokens in between."""
        chain = []  # the states between the starting point and ``state``, deepest first
        s = state
        while s != self._at and s != 0 and s not in self._snapshots:
            chain.append(s)
            s = self._parent[s]
        if s != self._at:
            self._matcher = (self._snapshots[s] if s else self._root).deep_copy()
        for s in reversed(chain):  # legal by construction: step() checked each parent's mask
            ok = self._matcher.consume_token(self._token[s])
            assert ok, self._matcher.get_error()
        self._at = state

    def _snapshot(self) -> None:
        """Keep a copy of the matcher at its state: later paths through it start there."""
        self._snapshots[self._at] = self._matcher.deep_copy()
        self._snapshots.move_to_end(self._at)
        if len(self._snapshots) > SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def _legal_mask(self, state: int) -> np.ndarray:
        """Legal ids as a bool array (V,), EOS included iff accepting; cached (LRU)."""
        if state in self._legal_masks:
            self._legal_masks.move_to_end(state)
            return self._legal_masks[state]
        m = np.zeros(self.vocab_size, dtype=bool)
        if state == FINISHED:  # only EOS "continues": a harmless row for drafts ending in EOS
            m[self.eos_id] = True
        else:
            with self._lock:
                self._goto(state)
                bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
                if self._matcher.is_error():  # a limit hit (compile_grammar then builds anew)
                    raise ConstraintError(f"llguidance: {self._matcher.get_error()[:500]}")
                self._accepting[state] = self._matcher.is_accepting()
                self._snapshot()
            n = len(self.vocab.token_bytes)
            m[:n] = np.unpackbits(bits, bitorder="little")[:n].astype(bool) & self._plain
            m[self.eos_id] = self._accepting[state]  # EOS exactly where the text is complete
        self._legal_masks[state] = m
        if len(self._legal_masks) > MASK_CACHE:
            self._legal_masks.popitem(last=False)
        return m

    def _legal(self, state: int) -> np.ndarray:
        return np.flatnonzero(self._legal_mask(state))

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``, ``FINISHED`` after a legal EOS, ``None`` if illegal."""
        if state == FINISHED:
            return None
        if token == self.eos_id:
            return FINISHED if self.accepting(state) else None
        if not 0 <= token < self.vocab_size or not self._legal_mask(state)[token]:
            return None
        child = self._children.get((state, token))
        if child is None:
            with self._lock:
                child = self._children[(state, token)] = len(self._parent)
                self._parent.append(state)
                self._token.append(token)
                self._depth.append(self._depth[state] + 1)
        return child

    def accepting(self, state: int) -> bool:
        """True iff the text so far is a complete match (EOS is legal here)."""
        if state == FINISHED:
            return False
        if state not in self._accepting:
            self._legal_mask(state)  # computes it with the mask, from the same matcher position
        return self._accepting[state]

    def forced(self, state: int) -> int | None:
        """The only legal token, if exactly one (its probability is 1 under any policy)."""
        legal = self._legal(state)
        return int(legal[0]) if len(legal) == 1 else None

    def forced_text(self, state: int, limit: int = 64) -> bytes:
        """The bytes every continuation from ``state`` starts with (llguidance's fast-forward
        bytes); none where the match may end here."""
        if state == FINISHED or self.accepting(state):
            return b""
        with self._lock:
            self._goto(state)
            return self._matcher.compute_ff_bytes()[:limit]

    def mask(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean mask of legal ids, (V,) with V the model's logits width; cached (LRU)."""
        key = (state, torch.device(device))
        if key in self._masks:
            self._masks.move_to_end(key)
            return self._masks[key]
        legal = self._legal_mask(state)
        if not legal.any():
            raise ConstraintError(
                f"state {state} has no legal token: the constraint cannot "
                "be completed with this vocabulary."
            )
        self._masks[key] = torch.from_numpy(legal).to(key[1])
        if len(self._masks) > MASK_CACHE:
            self._masks.popitem(last=False)
        return self._masks[key]

    def accepts_tokens(self, tokens: list[int]) -> bool:
        """True iff the tokens (optionally ending in EOS) form a complete accepted text; asked of
        llguidance's parser directly (no masks: fast for long texts). tests/test_guidance.py
        checks that its answers and the masks agree."""
        body = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
        if any(not 0 <= t < len(self.vocab.token_bytes) or not self._plain[t] for t in body):
            return False  # EOS inside, special tokens, ids beyond the tokenizer
        matcher = self._root.deep_copy()  # no rollback (see the module docstring)
        done = matcher.try_consume_tokens(body)
        return done == len(body) and matcher.is_accepting()

    def clear_caches(self) -> None:
        """Drop the cached masks (states stay valid; masks rebuild on use)."""
        self._legal_masks.clear()
        self._masks.clear()


@cache
def _vocab_tables(vocab: TokenVocabulary) -> tuple[dict[int, int], np.ndarray]:
    """{byte: its single-byte token} (for ``accepts``) and which ids carry text, per vocabulary."""
    byte_ids = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1}
    return byte_ids, np.array([bool(b) for b in vocab.token_bytes])


@cache
def _ll_tokenizer(vocab: TokenVocabulary) -> llg.LLTokenizer:
    """llguidance's view of the exact byte vocabulary: ids without text (EOS, chat markers)
    become special tokens, which no grammar here can produce."""
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokenizer(vocab)))


class _ByteTokenizer:
    """The TokenizerWrapper interface over a TokenVocabulary (greedy longest match encoding:
    llguidance only uses it to tokenize grammar literals, never for masks)."""

    def __init__(self, vocab: TokenVocabulary):
        self.vocab, self.eos_token_id, self.bos_token_id = vocab, vocab.eos_id, None
        self.tokens = [b if b else b"\xff[%d]" % i for i, b in enumerate(vocab.token_bytes)]
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if not b]

    def __call__(self, data: bytes) -> list[int]:
        ids, pos, table = [], 0, self.vocab.ids_by_bytes
        while pos < len(data):
            for end in range(min(len(data), pos + self.vocab.max_token_bytes), pos, -1):
                if (token := table.get(data[pos:end])) is not None:
                    ids.append(token)
                    pos = end
                    break
            else:
                pos += 1  # a byte no token spells alone (never in a byte-level vocabulary)
        return ids


_compiled: OrderedDict[tuple[str, str, int], GuidanceConstraint] = OrderedDict()


def compile_grammar(
    grammar: str, vocab: TokenVocabulary, vocab_size: int, source: str
) -> GuidanceConstraint:
    """Compile an llguidance grammar (from ``schema_grammar``, ``regex_grammar`` or
    ``lark_grammar``) for this vocabulary; cached in memory (LRU)."""
    key = (grammar, vocab.fingerprint, vocab_size)
    cached = _compiled.get(key)
    if cached is not None and len(cached._parent) < MAX_STATES and not cached._matcher.is_error():
        _compiled.move_to_end(key)
    else:
        _compiled[key] = GuidanceConstraint(grammar, vocab, vocab_size, source)
        if len(_compiled) > COMPILED_CACHE:
            _compiled.popitem(last=False)
    return _compiled[key]


# llguidance narrows the mask where the grammar forces bytes: to the one token its tokenizer
# would spell them with ("forcing ff_token by mask"), e.g. `yes` but not `y` where "yes" is forced.
# Our masks must hold every token whose bytes keep the text a prefix of an accepted string (the
# exactness claims are about that mask), so every grammar is compiled with forcing off. Appended
# last, so that line numbers in a grammar's error messages stay the user's.
NO_FORCING = '\n%llguidance {"no_forcing": true}\n'


def schema_grammar(schema: dict, whitespace: str = "") -> str:
    """llguidance's grammar for a JSON Schema: compact JSON (``whitespace`` = "") or ``whitespace``
    (a regex) between tokens. A keyword it cannot honour is refused by name, never ignored."""
    schema = _in_llguidance_terms(schema)
    schema = _sound_for_llguidance(schema)
    if _closable(schema):
        schema = _close_objects(schema)
    options = {"whitespace_flexible": False, "lenient": False}
    if whitespace:
        options |= {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    try:
        text = json.dumps(schema | {"x-guidance": options}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the schema is not plain JSON: {e}") from None
    grammar = "start: %json " + text + NO_FORCING
    _check(grammar, "the schema")
    return grammar


# Where llguidance accepts texts that jsonschema (with its format checker) rejects, found by
# benchmarks/coverage_engines.py and a fuzz of every format (docs/schemas.md): a leap second
# "23:59:60" and some offsets in date-time / time; multipleOf with a fraction, which llguidance
# checks in exact decimals and jsonschema in floats ("9356.55" is no multiple of 0.01 there).
# Formats llguidance checks soundly stay its own; the other formats the regex engine writes as a
# regex become that regex as a pattern; format names jsonschema does not check are annotations
# (dropped, as the regex engine does); the rest llguidance implements or refuses by name.
NATIVE_FORMATS = {"date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"}
VALUES = {"enum", "const", "default", "examples"}  # JSON values, not schemas: never rewritten


# Keywords whose values map names (of properties, definitions) to schemas: the names are no
# keywords, whatever they spell.
NAME_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
DEPENDENCIES = ("dependencies", "dependentRequired", "dependentSchemas")


def _rewrite(node, change):
    """``change(node, copy)`` applied bottom up to every subschema, where ``copy`` is the node
    with its subschemas already changed; JSON values and property names are left alone."""
    if isinstance(node, list):
        return [_rewrite(v, change) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in VALUES:
            out[k] = v
        elif k in (*NAME_MAPS, *DEPENDENCIES) and isinstance(v, dict):
            out[k] = {name: _rewrite(schema, change) for name, schema in v.items()}
        else:
            out[k] = _rewrite(v, change)
    return change(node, out)


def _in_llguidance_terms(schema):
    """The schema with keywords llguidance refuses said in ones it implements, accepting the
    same instances:
    - a oneOf no instance can satisfy twice becomes an anyOf (``_exclusive``);
    - ``dependencies`` (draft 4–7; ``dependentRequired``/``dependentSchemas`` since 2019-09)
      becomes an allOf of "the name is absent, or present with what it needs": anyOf [{properties: {name: false}}, {required: [name, ...]}] for a list
      of names, anyOf [{properties: {name: false}}, {required: [name], allOf: [schema]}] for a
      schema (both vacuous on non-objects, as dependencies is);
    - ``not``: a double negation is what it negates; a negated ``required``, ``type``, empty or
      boolean schema is said positively (``_affirmed``); any other ``not`` stays, refused."""
    schema = _rewrite(schema, _without_double_negation)
    local_refs = not _nested_ids(schema)

    def change(node, out):
        if isinstance(node.get("oneOf"), list) and "anyOf" not in node:
            if _exclusive(node, schema, local_refs):
                out["anyOf"] = out.pop("oneOf")
        for keyword in DEPENDENCIES:
            deps = out.get(keyword)
            if isinstance(deps, dict) and all(_dependency(d) for d in deps.values()):
                del out[keyword]
                needs = [_if_present(n, d) for n, d in deps.items()]
                out["allOf"] = [*out.get("allOf", []), *needs]
        if "not" in out and (affirmed := _affirmed(out["not"])) is not None:
            del out["not"]
            out["allOf"] = [*out.get("allOf", []), affirmed]
        return out

    return _rewrite(schema, change)


ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated"}
TYPES = {"null", "boolean", "object", "array", "number", "string"}  # integer: within number


def _keywords(node: dict) -> set:
    return set(node) - ANNOTATIONS


def _without_double_negation(node, out):
    inner = out.get("not")
    if isinstance(inner, dict) and _keywords(inner) == {"not"}:
        del out["not"]
        out["allOf"] = [*out.get("allOf", []), inner["not"]]
    return out


def _affirmed(negated):
    """A schema accepting exactly what {"not": negated} accepts, where llguidance needs it said
    positively; None for the forms left to refuse."""
    if negated is True or (isinstance(negated, dict) and not _keywords(negated)):
        return False
    if negated is False:
        return True
    if not isinstance(negated, dict):
        return None
    keys, names, kinds = _keywords(negated), negated.get("required"), negated.get("type")
    if keys == {"allOf"} and isinstance(negated["allOf"], list) and len(negated["allOf"]) == 1:
        return _affirmed(negated["allOf"][0])  # as a triple negation leaves it
    if keys == {"required"} and isinstance(names, list) and names:
        if all(isinstance(n, str) for n in names):  # an object missing one of them (`required`
            missing = [{"properties": {n: False}} for n in names]  # holds on non-objects)
            return {"type": "object", "anyOf": missing}
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else None
    if keys == {"type"} and kinds is not None and kinds <= TYPES | {"integer"}:
        if "integer" in kinds and "number" not in kinds:
            return None  # the fractional numbers are no type of their own
        rest = sorted(TYPES - kinds)
        return {"type": rest} if rest else False
    return None


def _dependency(dep) -> bool:
    return isinstance(dep, dict | bool) or (
        isinstance(dep, list) and all(isinstance(n, str) for n in dep)
    )


def _if_present(name: str, dep) -> dict:
    needs = {"required": [name, *dep]} if isinstance(dep, list) else {"required": [name]}
    if not isinstance(dep, list):
        needs["allOf"] = [dep]
    return {"anyOf": [{"properties": {name: False}}, needs]}


def _exclusive(node: dict, root, local_refs: bool) -> bool:
    resolve = (lambda b: _resolve(b, root)) if local_refs else (lambda b: b)
    branches = [resolve(b) for b in node["oneOf"]]
    if len(branches) < 2 or not all(isinstance(b, dict) and "$ref" not in b for b in branches):
        return False
    types = [_types(b) for b in branches]
    pairs = list(itertools.combinations(range(len(branches)), 2))
    if all(t is not None for t in types) and all(not types[i] & types[j] for i, j in pairs):
        return True
    if node.get("type") != "object" and any(t != {"object"} for t in types):
        return False  # a non-object instance satisfies every branch's `required`
    tags = [_tags(b, resolve) for b in branches]
    for name in set.intersection(*(set(t) for t in tags)):
        if all(not tags[i][name] & tags[j][name] for i, j in pairs):
            return True
    return False


def _resolve(node, root, depth: int = 0):
    """A local "#/..." $ref's target (followed up to 8 times), else the node itself."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#/") or depth > 8:
        return node
    target = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return node
        target = target[part]
    return _resolve(target, root, depth + 1)


def _types(branch: dict) -> set | None:
    kind = branch.get("type")
    kinds = {kind} if isinstance(kind, str) else kind
    if not isinstance(kinds, list | set) or not all(isinstance(k, str) for k in kinds):
        return None
    kinds = set(kinds)
    return kinds | {"integer", "number"} if kinds & {"integer", "number"} else kinds


def _tags(branch: dict, resolve) -> dict:
    """Required property → the set of its const/enum values (JSON equality: 1 == 1.0, not True)."""
    required, declared = branch.get("required"), branch.get("properties")
    if not isinstance(required, list) or not isinstance(declared, dict):
        return {}
    tags = {}
    for name in required:
        spec = resolve(declared.get(name)) if isinstance(name, str) else None
        if isinstance(spec, dict) and "const" in spec:
            tags[name] = {_json_key(spec["const"])}
        elif isinstance(spec, dict) and isinstance(spec.get("enum"), list):
            tags[name] = {_json_key(v) for v in spec["enum"]}
    return tags


def _json_key(value):
    """Equal keys for JSON-equal scalars; one key for all arrays and objects (their members'
    numbers compare as numbers too: never told apart here)."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    return ("string", value) if isinstance(value, str) else ("composite",)


def _nested_ids(node, root: bool = True) -> bool:
    """Whether a subschema below the root sets $id (or draft 4's id): local refs resolve
    against the root only where none does."""
    if isinstance(node, list):
        return any(_nested_ids(v, False) for v in node)
    if not isinstance(node, dict):
        return False
    if not root and (isinstance(node.get("$id"), str) or isinstance(node.get("id"), str)):
        return True
    for k, v in node.items():
        if k in VALUES:
            continue
        if k in NAME_MAPS:
            if isinstance(v, dict) and any(_nested_ids(s, False) for s in v.values()):
                return True
        elif _nested_ids(v, False):
            return True
    return False


def _sound_for_llguidance(node, pointer: str = ""):
    """A copy of the schema in which llguidance accepts nothing jsonschema rejects."""
    from .schema.regex import FORMATS, KNOWN_FORMATS

    if isinstance(node, list):
        return [_sound_for_llguidance(v, f"{pointer}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {
        k: v if k in VALUES else _sound_for_llguidance(v, f"{pointer}/{k}") for k, v in node.items()
    }
    step = node.get("multipleOf")
    if isinstance(step, (int, float)) and not float(step).is_integer():
        raise UnsupportedSchemaError("multipleOf", pointer, _LOOSER)
    fmt = node.get("format")
    if isinstance(fmt, str) and fmt not in NATIVE_FORMATS:
        if fmt not in KNOWN_FORMATS:
            del out["format"]  # an annotation: jsonschema checks nothing
        elif fmt in FORMATS and "pattern" not in node:
            del out["format"]
            out["pattern"] = f"^{FORMATS[fmt]}$"
    return out


_LOOSER = "llguidance would accept texts jsonschema rejects here."

# Objects with declared properties get no undeclared ones where the schema says nothing about
# them (additionalProperties: false), the regex engine's subset too: allowed, the small default
# model filled objects with invented keys or echoed the schema itself (docs/measurements.md).
# Sound because it only happens in schemas without negation (`not`, `oneOf`'s "exactly one",
# `if`): there every subschema counts positively, so narrowing one narrows the whole (under
# oneOf, closing a branch lets instances valid under two branches through: the coverage run
# caught it). Nor with allOf or a $ref beside properties, where closing one schema would reject
# the properties another declares.
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
NOT_CLOSABLE = ("not", "oneOf", "if", "allOf")


def _close_objects(node):
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in VALUES else _close_objects(v) for k, v in node.items()}
    declared, required = node.get("properties"), node.get("required")
    if (
        isinstance(declared, dict)
        and not any(k in node for k in OPEN_KEYS)
        and (not isinstance(required, list) or {str(r) for r in required} <= set(declared))
    ):  # a required name not declared stays possible
        out["additionalProperties"] = False
    return out


def _closable(node) -> bool:
    """No negation, no allOf and no $ref beside properties anywhere (JSON values aside)."""
    if isinstance(node, list):
        return all(_closable(v) for v in node)
    if not isinstance(node, dict):
        return True
    if any(k in node for k in NOT_CLOSABLE) or ("$ref" in node and "properties" in node):
        return False
    return all(_closable(v) for k, v in node.items() if k not in VALUES)


def regex_grammar(regex: str) -> str:
    """llguidance's grammar for a regex the whole output must match (Rust regex syntax)."""
    lark = json.loads(llg.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
    grammar = lark + NO_FORCING
    _check(grammar, f"the regex {regex[:80]!r}")
    return grammar


def lark_grammar(text: str) -> str:
    """llguidance's grammar for a Lark grammar, or a GBNF one (converted to Lark by llguidance's
    converter); a syntax error names its line and column."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:
        lark = any_to_lark(text)
    except GbnfToLarkError as e:
        line, col = _line_col(text, e.pos.pos)
        raise ConstraintError(f"GBNF syntax error at line {line}, column {col}: {e}") from None
    grammar = lark + NO_FORCING
    _check(grammar, "the grammar")
    return grammar


# llguidance names what it cannot do: "Unimplemented keys: [\"not\"]", "Unknown format: ...".
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[\"?([^\]\"]+)")
_NOT_SUPPORTED = re.compile(r"(\w+) constraints are not supported")  # oneOf
_UNKNOWN_FORMAT = re.compile(r"[Uu]nknown format: ?\"?([\w-]+)")
_LOCATION = re.compile(r"(?:^|at )(\d+)\((\d+)\): ", re.M)  # "at 3(4): ": line 3, column 4


def _check(grammar: str, what: str) -> None:
    error = llg.LLMatcher.validate_grammar(grammar)  # without a tokenizer: syntax and keywords
    if not error:
        return
    if m := _UNIMPLEMENTED.search(error):
        raise UnsupportedSchemaError(m.group(1), "", "llguidance does not implement it.")
    if m := _NOT_SUPPORTED.search(error):
        raise UnsupportedSchemaError(m.group(1), "", "llguidance does not implement it.")
    if m := _UNKNOWN_FORMAT.search(error):
        raise UnsupportedSchemaError(f"format: {m.group(1)}", "", "No engine checks this format.")
    if m := _LOCATION.search(error):
        line, col = m.groups()
        error = f"{error[: m.start()]}line {line}, column {col}: {error[m.end() :]}"
    error = "\n".join(x for x in error.splitlines() if '"no_forcing"' not in x)  # ours, not theirs
    if what != "the grammar":  # locations and the echo are in the generated grammar line
        error = re.sub(r"^at \d+\(\d+\): ", "", error.split("\n", 1)[0])
    raise ConstraintError(f"cannot compile {what}: {error.strip()[:2000]}")


def _line_col(text: str, pos: int) -> tuple[int, int]:
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


# --- which engine compiles what ----------------------------------------------------------------

ENGINES = {
    "auto": "llguidance; a schema keyword it does not implement goes to the regex engine, "
    "which honours it exactly or refuses it by name (docs/schemas.md: why)",
    "llguidance": "llguidance's Earley parser: schemas, regexes and Lark/GBNF grammars, "
    "compiled in milliseconds, masks computed per state",
    "regex": "constrained_spec.schema → regex → outlines-core token automaton: masks "
    "precomputed per state, compiled in a bounded child process (schemas, regexes)",
}


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ConstraintError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}.")
    return engine


def translate(
    engine: str, whitespace: str = "", schema=None, regex=None, grammar=None
) -> tuple[str, str]:
    """``(engine, text)``: the grammar (llguidance) or regex (regex engine) a request compiles to,
    without a tokenizer: refusals and syntax errors surface here, before any model work. Under
    "auto" a schema llguidance cannot compile goes to the regex engine's front end, which
    compiles it exactly or refuses it naming the keyword and its JSON pointer."""
    check_engine(engine)
    if sum(x is not None for x in (schema, regex, grammar)) != 1:
        raise ConstraintError("pass exactly one of schema=, regex= or grammar=.")
    if grammar is not None:
        if engine == "regex":
            raise ConstraintError(
                "grammars (Lark/GBNF) need engine='llguidance' or 'auto': the regex "
                "engine compiles regular languages only."
            )
        return "llguidance", lark_grammar(grammar)
    if regex is not None:
        return ("regex", regex) if engine == "regex" else ("llguidance", regex_grammar(regex))
    if engine != "regex":
        try:
            return "llguidance", schema_grammar(schema, whitespace)
        except ConstraintError:
            if engine == "llguidance":
                raise
    from .compile import translate_schema  # the sound path (bounded) for what llguidance lacks

    return "regex", translate_schema(schema, whitespace)


def compile_constraint(
    engine: str, vocab: TokenVocabulary, vocab_size: int, cache_dir=None, whitespace="", **given
) -> Constraint:
    """The compiled constraint for ``given`` (one of schema=, regex=, grammar=) by ``engine``."""
    from .compile import compile_regex

    chosen, text = translate(engine, whitespace, **given)
    if chosen == "llguidance":
        what = next(k for k in given if given[k] is not None)
        try:
            return compile_grammar(text, vocab, vocab_size, what)
        except ConstraintError:
            if engine != "auto" or what != "schema":
                raise
            chosen, text = translate("regex", whitespace, **given)  # e.g. a lexer limit hit
    return compile_regex(text, vocab, vocab_size, cache_dir)
