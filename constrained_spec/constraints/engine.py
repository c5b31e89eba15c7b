"""The constraint engine: llguidance compiles JSON Schemas (said in its terms by ``rewrite``),
regexes and Lark/GBNF grammars in milliseconds; its Earley parser computes each state's mask
over the exact token bytes.

llguidance's cursor (an ``LLMatcher``) is stateful; our states are ints: state s names a token
path from the start (a trie of (parent state, token)), and ``_goto`` is the one place that moves
the matcher onto a path: it copies the matcher of the nearest state on that path it has a
snapshot of (a copy costs ~2 µs) and consumes the rest, never calling llguidance's rollback:
after rollbacks with masks computed along the way, llguidance 1.9.1 returned a mask allowing a
token that a fresh matcher on the same path refuses (tests/test_constraints.py replays such a
sequence). Stepping never moves the matcher (a step is legal iff the parent's mask allows the
token), so exploring a draft costs one mask per new state, and rolling back to the committed
prefix is keeping the old int.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from functools import cache, lru_cache

import llguidance as llg
import numpy as np
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from ..errors import ConstraintError, SchemaTooComplex, UnsupportedSchemaError
from . import closing, rewrite
from .closing import Completion
from .schemas import check_schema, load_schema
from .vocabulary import TokenVocabulary

FINISHED = -1  # the state after EOS: nothing is legal any more

MASK_CACHE = 256  # bitmasks kept per constraint (FIFO; a 49k vocabulary's: 6 kB each)
# Bool masks kept per constraint (LRU): V bytes each (49 kB at 49k, 262 kB at Gemma's 262k), 8x a
# bitmask, and rebuilt from it in one unpack (no llguidance call). A round asks for its newest
# states' masks; at 256 the 20 busy schemas of benchmarks/serve.py soak filled theirs for 10,000 requests
# (RSS +46% after the first 1,000, docs/server.md "Memory").
BOOL_MASKS = 32
SNAPSHOTS = 256  # matcher copies kept per constraint (LRU)
# A copy is kept of every SNAPSHOT_EVERY-th state along a path whose mask was computed: going back
# to a state then consumes at most SNAPSHOT_EVERY - 1 tokens more after the copy; a copy costs
# about what consuming a token does, and most states are never gone back to (only a round's last
# accepted one, when a draft token was rejected).
SNAPSHOT_EVERY = 2
COMPILED_CACHE = 32  # constraints kept in memory (LRU), by grammar × vocabulary
# The trie of states grows with every token path asked about (~100 bytes a state); past this many
# states, compile_grammar hands later requests a fresh constraint (3 ms) instead of the cached one,
# whose states stay valid for the requests still holding it.
MAX_STATES = 1_000_000
COMPLETIONS = 16384  # completions kept per constraint (LRU; a lost one is found again the same way)
BYTE_MATCHERS = 256  # byte-level matcher copies kept per constraint (LRU), for completions


class GuidanceConstraint:
    """A compiled llguidance grammar over a token vocabulary, with int states (see module doc):
    the one implementation of the ``Constraint`` protocol."""

    def __init__(self, grammar: str, vocab: TokenVocabulary, vocab_size: int, source: str):
        self.vocab, self.vocab_size, self.eos_id = vocab, vocab_size, vocab.eos_id
        self.source = source  # what was compiled: "schema", "regex" or "grammar"
        root = llg.LLMatcher(_ll_tokenizer(vocab), grammar, log_level=0)
        if root.is_error():
            raise ConstraintError(f"cannot compile {source}: {root.get_error()}")
        self._root, self._matcher, self._at = root, root.deep_copy(), 0  # _at: _matcher's state
        self._copied_at = 0  # the depth of the last copy on _matcher's path (taken or started from)
        self._snapshots: OrderedDict[int, llg.LLMatcher] = OrderedDict()
        self.initial_state = 0
        self._parent, self._token, self._depth = [-1], [-1], [0]  # the trie, by state
        self._children: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()  # one matcher, shared by the requests using this constraint
        self._bits: dict[int, bytes] = {}  # legal ids by state, see _legal_bits
        self._masks: OrderedDict[tuple[int, torch.device], torch.Tensor] = OrderedDict()
        self._accepting: dict[int, bool] = {}
        self._byte_ids, self._plain, self._plain_bits = _vocab_tables(vocab)
        self._width = (vocab_size + 7) // 8  # bytes in a state's bitmask
        self._textless = _textless_spans(vocab, self._width)
        self._eos_at = divmod(self.eos_id, 8)  # EOS's byte and bit in a bitmask
        self._grammar = grammar
        self._completions: OrderedDict[int, Completion | None] = OrderedDict()
        self._byte_matchers: OrderedDict[int, llg.LLMatcher] = OrderedDict()
        self._none_legal = bytes(self._width)
        # the first mask now: a grammar whose language is empty (a schema that is only
        # {"$ref": "#"}) fails here, at compile time, not at a request's first token
        try:
            if self._legal_bits(0) == self._none_legal:
                raise ConstraintError(f"the {source} accepts no text: nothing can be generated.")
        except SchemaTooComplex as e:  # llguidance's "no token extends the empty text"
            if "NoExtensionBias" not in str(e):
                raise
            raise ConstraintError(
                f"the {source} accepts no text: nothing can be generated."
            ) from None

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
            self._copied_at = self._depth[s]
        for s in reversed(chain):  # legal by construction: step() checked each parent's mask
            ok = self._matcher.consume_token(self._token[s])
            assert ok, self._matcher.get_error()
        self._at = state

    def _snapshot(self) -> None:
        """Keep a copy of the matcher at its state: later paths through it start there."""
        self._snapshots[self._at] = self._matcher.deep_copy()
        self._copied_at = self._depth[self._at]
        self._snapshots.move_to_end(self._at)
        if len(self._snapshots) > SNAPSHOTS:
            self._snapshots.popitem(last=False)

    def _legal_bits(self, state: int) -> bytes:
        """The legal ids as a bitmask (bit t of byte t // 8, V bits), EOS included iff accepting;
        cached (the oldest go first). Bytes rather than an array because in decoding every numpy
        or torch call right after a forward costs 10–35 µs (the forward's weights evict their
        code and data from the caches; benchmarks/mask_eviction.py): a step tests one bit in
        plain Python, a round's masks become tensors in one conversion (``masks``)."""
        bits = self._bits.get(state)
        if bits is not None:
            return bits
        if state == FINISHED:  # only EOS "continues": a harmless row for drafts ending in EOS
            bits = (1 << self.eos_id).to_bytes(self._width, "little")
        else:
            with self._lock:
                self._goto(state)
                raw = self._matcher.compute_bitmask()
                if self._matcher.is_error():  # a limit hit (compile_grammar then builds anew)
                    raise SchemaTooComplex(f"llguidance: {self._matcher.get_error()[:500]}")
                accepting = self._accepting[state] = self._matcher.is_accepting()
                if self._depth[state] - self._copied_at >= SNAPSHOT_EVERY:
                    self._snapshot()
            bits = self._ours(raw, accepting)
        with self._lock:
            self._bits[state] = bits
            if len(self._bits) > MASK_CACHE:  # the oldest: decoding asks for the newest states
                del self._bits[next(iter(self._bits))]
        return bits

    def _ours(self, raw: bytes, accepting: bool) -> bytes:
        """llguidance's bitmask ``raw`` (whole 32-bit words) as ours: V bits, no id without text
        (a grammar may name a special token by id), EOS iff ``accepting``. A row that already is
        (every schema's and regex's) is kept as it is: after a forward, each pass over its bytes
        is a cold one."""
        eos_byte, eos_bit = self._eos_at
        if (
            len(raw) >= self._width
            and (raw[eos_byte] >> eos_bit & 1) == accepting
            and not any(int.from_bytes(raw[a:b], "little") & m for a, b, m in self._textless)
        ):  # (ids past V's bytes are dropped, and V's last byte's spare bits are among textless)
            return raw if len(raw) == self._width else raw[: self._width]
        legal = int.from_bytes(raw, "little") & self._plain_bits  # no special tokens, ...
        legal |= accepting << self.eos_id  # ... EOS where the text is complete
        return legal.to_bytes(self._width, "little")

    def _legal(self, state: int) -> np.ndarray:
        return np.flatnonzero(self._unpack([self._legal_bits(state)])[0])

    def _unpack(self, rows: list[bytes]) -> np.ndarray:
        """Bitmasks → a bool array (len(rows), V)."""
        packed = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), self._width)
        return np.unpackbits(packed, axis=1, count=self.vocab_size, bitorder="little").view(bool)

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``, ``FINISHED`` after a legal EOS, ``None`` if illegal."""
        child = self._children.get((state, token))
        if child is not None:  # legal: a child is made only after its test (drafts step twice)
            return child
        if state == FINISHED:
            return None
        if token == self.eos_id:
            return FINISHED if self.accepting(state) else None
        if not 0 <= token < self.vocab_size:
            return None
        if not self._legal_bits(state)[token >> 3] >> (token & 7) & 1:
            return None
        with self._lock:
            child = self._children.setdefault((state, token), len(self._parent))
            if child == len(self._parent):  # (another thread may have made it meanwhile)
                self._parent.append(state)
                self._token.append(token)
                self._depth.append(self._depth[state] + 1)
        return child

    def accepting(self, state: int) -> bool:
        """True iff the text so far is a complete match (EOS is legal here)."""
        if state == FINISHED:
            return False
        if state not in self._accepting:
            self._legal_bits(state)  # computes it with the mask, from the same matcher position
        return self._accepting[state]

    def forced(self, state: int) -> int | None:
        """The only legal token, if exactly one (its probability is 1 under any policy)."""
        legal = int.from_bytes(self._legal_bits(state), "little")
        return legal.bit_length() - 1 if legal.bit_count() == 1 else None

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
        self._masks[key] = self._tensor([state], key[1])[0]
        if len(self._masks) > BOOL_MASKS:
            self._masks.popitem(last=False)
        return self._masks[key]

    def masks(self, states: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """The masks of ``states`` stacked, (len(states), V) bool: a pass's legal tokens, in one
        conversion (a single state's from the cache: a baseline step)."""
        return (
            self.mask(states[0], device)[None] if len(states) == 1 else self._tensor(states, device)
        )

    def bitmasks(self, states: list[int]) -> list[bytes]:
        """The legal ids of each state as a bitmask (bit t of byte t // 8, V bits): what the
        decoding layer unpacks into a pass's masks, with the target's own unpacking where it
        has one. A state with no legal token is an error: nothing could be generated there."""
        rows = [self._legal_bits(s) for s in states]
        if self._none_legal in rows:
            raise ConstraintError(
                f"state {states[rows.index(self._none_legal)]} has no legal token: the "
                "constraint cannot be completed with this vocabulary."
            )
        return rows

    def _tensor(self, states: list[int], device) -> torch.Tensor:
        masks = torch.from_numpy(self._unpack(self.bitmasks(states)))
        on_cpu = getattr(device, "type", device) == "cpu"  # a torch.device or its name
        return masks if on_cpu else masks.to(device)  # (a cold torch call fewer on the CPU)

    def completion(self, state: int) -> Completion | None:
        """How the output can finish from ``state``: a text the grammar accepts to the end (then
        EOS) and the tokens that spell it, EOS included; None if none was found. A function of
        the state (of its token path): the parent's completion less the token's bytes, where it
        began with them; the parent's, where it still finishes the text after the token; else a
        walk from the state (``closing.complete``). Along the first, a completion's first token
        leads to a state whose completion takes one token fewer: a reply that could finish in
        time still can after it (the budget mask, decoding/budget.py)."""
        if state == FINISHED:
            return Completion(b"", 0)
        with self._lock:
            chain, s = [], state  # the states down to ``state`` whose completion is not kept
            while s not in self._completions and s != 0:
                chain.append(s)
                s = self._parent[s]
            if s not in self._completions:
                self._completions[0] = self._walk(0)
            found = self._completions[s]
            self._completions.move_to_end(s)
            for s in reversed(chain):
                found = self._completions[s] = self._child_completion(s, found)
            while len(self._completions) > COMPLETIONS:
                self._completions.popitem(last=False)
            return found

    def _child_completion(self, state: int, parent: Completion | None) -> Completion | None:
        data = self.vocab.token_bytes[self._token[state]]
        if parent is not None and parent.text.startswith(data):
            return self._spelled(parent.text[len(data) :])
        matcher = self._bytes_at(state)
        if matcher is None:  # llguidance's limits, on the byte-level path: no completion known
            return None
        if parent is not None and closing.accepts_ending(matcher, parent.text, _BYTE_EOS):
            return parent
        return self._walk(state)

    def _walk(self, state: int) -> Completion | None:
        path = []
        s = state
        while s != 0:
            path.append(self.vocab.token_bytes[self._token[s]])
            s = self._parent[s]
        matcher, hints = self._bytes_at(state), _hints(self._grammar)
        if matcher is None:
            return None
        text = closing.complete(
            matcher.deep_copy(),
            _BYTE_EOS,
            self.source == "schema",
            hints,
            b"".join(reversed(path)),
            _spelled_bytes(self.vocab),
        )
        return None if text is None else self._spelled(text)

    def _spelled(self, text: bytes) -> Completion | None:
        tokens = self.vocab.spelled_length(text)
        return None if tokens is None else Completion(text, tokens + 1)

    def _bytes_at(self, state: int) -> llg.LLMatcher | None:
        """A byte-level matcher on ``state``'s text (kept: do not consume from it); None where
        llguidance stops on the way (a limit of its parser: a byte at a time, a large schema's
        rows can outgrow what the model's tokens kept within)."""
        chain, s = [], state
        while s not in self._byte_matchers and s != 0:
            chain.append(s)
            s = self._parent[s]
        if s == 0 and 0 not in self._byte_matchers:
            root = llg.LLMatcher(_byte_tokenizer(), self._grammar, log_level=0)
            self._byte_matchers[0] = root
        matcher = self._byte_matchers[s]
        if chain:
            matcher = matcher.deep_copy()
            for s in reversed(chain):
                if not all(
                    matcher.consume_token(b) for b in self.vocab.token_bytes[self._token[s]]
                ):
                    return None
            self._byte_matchers[state] = matcher
        self._byte_matchers.move_to_end(state)
        while len(self._byte_matchers) > BYTE_MATCHERS:
            oldest = next(iter(self._byte_matchers))
            if oldest == 0:  # the root stays
                self._byte_matchers.move_to_end(0)
                continue
            del self._byte_matchers[oldest]
        return matcher

    def accepts_tokens(self, tokens: list[int]) -> bool:
        """True iff the tokens (optionally ending in EOS) form a complete accepted text; asked of
        llguidance's parser directly (no masks: fast for long texts). tests/test_constraints.py
        checks that its answers and the masks agree."""
        body = tokens[:-1] if tokens and tokens[-1] == self.eos_id else tokens
        if any(not 0 <= t < len(self.vocab.token_bytes) or not self._plain[t] for t in body):
            return False  # EOS inside, special tokens, ids beyond the tokenizer
        matcher = self._root.deep_copy()  # no rollback (see the module docstring)
        done = matcher.try_consume_tokens(body)
        return done == len(body) and matcher.is_accepting()

    def allowed(self, state: int) -> list[int]:
        """Legal token ids in ``state`` (EOS included iff accepting)."""
        return self._legal(state).tolist()

    def legal_prefix(self, state: int, tokens: list[int]) -> int:
        """How many leading ``tokens`` the automaton accepts from ``state``."""
        for n, token in enumerate(tokens):
            state = self.step(state, token)
            if state is None:
                return n
        return len(tokens)

    def tokenize(self, state: int, data: bytes, limit: int, prefer=frozenset()) -> list[int]:
        """Up to ``limit`` tokens spelling a prefix of ``data`` that the automaton accepts from
        ``state``: at each position the longest legal token in ``prefer`` (e.g. the tokens the
        model has chosen before), else the longest legal token."""
        tokens, pos, longest = [], 0, self.vocab.longest_by_start
        while pos < len(data) and len(tokens) < limit:
            candidates = []  # (token, state after, end), longest first
            for end in range(min(len(data), pos + longest.get(data[pos : pos + 2], 1)), pos, -1):
                token = self.vocab.ids_by_bytes.get(data[pos:end])
                if token is not None and (after := self.step(state, token)) is not None:
                    candidates.append((token, after, end))
                    if not prefer or token in prefer:
                        break  # the one chosen below: shorter ones would cost steps for nothing
            if not candidates:
                break  # no legal token spells the next bytes
            token, state, pos = next((c for c in candidates if c[0] in prefer), candidates[0])
            tokens.append(token)
        return tokens

    def accepts(self, text: str) -> bool:
        """True iff the automaton accepts this complete text (walked one byte token at a time,
        so no tokenization choice can hide an accept or a reject)."""
        data = text.encode()
        missing = {b for b in data if b not in self._byte_ids}
        if missing:
            raise ValueError(f"the vocabulary has no single-byte token for bytes {sorted(missing)}")
        return self.accepts_tokens([self._byte_ids[b] for b in data])

    def clear_caches(self) -> None:
        """Drop the cached masks and matcher copies (states stay valid; both rebuild on use)."""
        with self._lock:
            self._bits.clear()
            self._masks.clear()
            self._snapshots.clear()
            self._matcher, self._at, self._copied_at = self._root.deep_copy(), 0, 0
            self._completions.clear()
            self._byte_matchers.clear()


@cache
def _vocab_tables(vocab: TokenVocabulary) -> tuple[dict[int, int], np.ndarray, int]:
    """{byte: its single-byte token} (for ``accepts``), which ids carry text, and the same as
    an int's bits (bit t: id t), per vocabulary."""
    byte_ids = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1}
    plain = np.array([bool(b) for b in vocab.token_bytes])
    return byte_ids, plain, int.from_bytes(np.packbits(plain, bitorder="little"), "little")


@cache
def _textless_spans(vocab: TokenVocabulary, width: int) -> list[tuple[int, int, int]]:
    """The ids without text but EOS (special tokens, ids past the tokenizer's) as runs of the
    bitmask's bytes: (start, end, the ids' bits in raw[start:end] as an int)."""
    text = np.zeros(width * 8, dtype=bool)
    text[: len(vocab.token_bytes)] = [bool(b) for b in vocab.token_bytes]
    text[vocab.eos_id] = True
    bits = np.packbits(~text, bitorder="little")
    spans, start = [], None
    for i, byte in enumerate([*bits.tolist(), 0]):
        if byte and start is None:
            start = i
        elif not byte and start is not None:
            spans.append((start, i, int.from_bytes(bits[start:i].tobytes(), "little")))
            start = None
    return spans


_BYTE_EOS = 256  # EOS's id in the byte-level vocabulary of the completions' matcher


@cache
def _byte_tokenizer() -> llg.LLTokenizer:
    """The 256 bytes as tokens, then EOS: the vocabulary completions are walked in."""
    return _ll_tokenizer(
        TokenVocabulary(tuple(bytes([b]) for b in range(256)) + (None,), _BYTE_EOS)
    )


@cache
def _spelled_bytes(vocab: TokenVocabulary) -> frozenset[int]:
    return frozenset(range(256)) - set(vocab.missing_bytes)


@lru_cache(maxsize=64)
def _hints(grammar: str) -> tuple[bytes, ...]:
    return closing.hints(grammar)


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


def schema_grammar(schema: dict, whitespace: str = "", open_objects: bool = False) -> str:
    """llguidance's grammar for a JSON Schema: compact JSON (``whitespace`` = "") or ``whitespace``
    (a regex) between tokens; objects with declared properties closed to undeclared ones unless
    ``open_objects`` (rewrite.for_llguidance). The schema is checked first (``check_schema``).
    A keyword it cannot honour is refused by name and JSON pointer, never ignored. Remembered
    by the schema's JSON text: a server checks a request's schema before queueing it and its
    worker compiles it, and every request to a Generator compiles its schema (the checks and
    the rewriting take milliseconds)."""
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the schema is not plain JSON: {e}") from None
    return _schema_grammar(text, whitespace, open_objects)


@lru_cache(maxsize=256)
def _schema_grammar(text: str, whitespace: str, open_objects: bool) -> str:
    schema = check_schema(json.loads(text))
    sent = rewrite.for_llguidance(schema, open_objects)
    options = {"whitespace_flexible": False, "lenient": False}
    if whitespace:
        options |= {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    try:
        text = json.dumps(sent | {"x-guidance": options}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the schema is not plain JSON: {e}") from None
    grammar = "start: %json " + text + NO_FORCING
    try:
        _check(grammar, "the schema")
    except UnsupportedSchemaError as e:  # llguidance names the keyword; we say where it is
        where = e.pointer or rewrite.pointer_of(schema, e.keyword, sent)
        raise UnsupportedSchemaError(e.keyword, where, e.hint) from None
    return grammar


def regex_grammar(regex: str) -> str:
    """llguidance's grammar for a regex the whole output must match (Rust regex syntax)."""
    lark = json.loads(llg.LLMatcher.grammar_from_regex(regex))["grammars"][0]["lark_grammar"]
    grammar = lark + NO_FORCING
    _check(grammar, f"the regex {regex[:80]!r}")
    return grammar


def lark_grammar(text: str) -> str:
    """llguidance's grammar for a Lark grammar, or a GBNF one (converted to Lark by llguidance's
    converter); a syntax error names its line and column."""
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
_UNSAID = {
    "": "llguidance does not implement it (docs/schemas.md lists what is refused and why).",
    "oneOf": "llguidance has oneOf only as 'one branch and not the others', and these branches "
    "could not be negated here (docs/schemas.md).",
    "not": "This negation could not be said in llguidance's keywords (docs/schemas.md).",
}


def _check(grammar: str, what: str) -> None:
    error = llg.LLMatcher.validate_grammar(grammar)  # without a tokenizer: syntax and keywords
    if not error:
        return
    if m := _UNIMPLEMENTED.search(error) or _NOT_SUPPORTED.search(error):
        raise UnsupportedSchemaError(m.group(1), "", _UNSAID.get(m.group(1), _UNSAID[""]))
    if m := _UNKNOWN_FORMAT.search(error):
        raise UnsupportedSchemaError(f"format: {m.group(1)}", "", "No engine checks this format.")
    if m := _LOCATION.search(error):
        line, col = m.groups()
        error = f"{error[: m.start()]}line {line}, column {col}: {error[m.end() :]}"
    error = "\n".join(x for x in error.splitlines() if '"no_forcing"' not in x)  # ours, not theirs
    if what != "the grammar":  # locations and the echo are in the generated grammar line
        error = re.sub(r"^at \d+\(\d+\): ", "", error.split("\n", 1)[0])
    kind = SchemaTooComplex if _LIMITS.search(error) else ConstraintError
    raise kind(f"cannot compile {what}: {error.strip()[:2000]}")


# llguidance's own limits (sizes, nesting), as its messages name them: past them a constraint is
# too complex for it, however valid.
_LIMITS = re.compile(
    r"too large|stack level exceeded|too many|max is \d+|limit|fuel|Unable to determine", re.I
)


def _line_col(text: str, pos: int) -> tuple[int, int]:
    return text.count("\n", 0, pos) + 1, pos - (text.rfind("\n", 0, pos) + 1) + 1


CONSTRAINTS = ("schema", "regex", "grammar")


def grammar_for(whitespace: str = "", open_objects: bool = False, **given) -> str:
    """The llguidance grammar of one of ``schema=`` (what ``load_schema`` takes), ``regex=`` or ``grammar=``
    (Lark or GBNF text), without a tokenizer: refusals and syntax errors surface here, before
    any model work."""
    if sum(given.get(k) is not None for k in CONSTRAINTS) != 1 or not given.keys() <= set(
        CONSTRAINTS
    ):
        raise ConstraintError("pass exactly one of schema=, regex= or grammar=.")
    if given.get("grammar") is not None:
        return lark_grammar(given["grammar"])
    if given.get("regex") is not None:
        return regex_grammar(given["regex"])
    return schema_grammar(load_schema(given["schema"]), whitespace, open_objects)


def compile_constraint(
    vocab: TokenVocabulary, vocab_size: int, whitespace="", open_objects=False, **given
) -> GuidanceConstraint:
    """The compiled constraint for ``given`` (one of schema=, regex=, grammar=; see
    ``grammar_for``) over ``vocab``, masks ``vocab_size`` wide."""
    grammar = grammar_for(whitespace, open_objects, **given)
    source = next(k for k in CONSTRAINTS if given.get(k) is not None)
    return compile_grammar(grammar, vocab, vocab_size, source)
