"""Compile a constraint (JSON Schema or regex) into a token automaton over a model's vocabulary.

Vocabulary → Index (outlines-core, over exact token bytes) → Constraint (int states, cached masks).
The compiled ``Constraint`` is immutable in meaning and shared between requests; a request's
cursor is just an int state, so rollback is keeping the old int.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import pickle
import tempfile
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import torch
from outlines_core import Index, Vocabulary

from .errors import ConstraintError, SchemaTooComplex, SettingError
from .schema import schema_to_regex
from .vocab import TokenVocabulary

try:  # POSIX only: without it the compile runs with a time bound alone (warned once)
    import resource
except ImportError:
    resource = None
# The memory bound counts the address space a child inherits, read from /proc (Linux).
_STATM = Path("/proc/self/statm")
MEMORY_BOUND = resource is not None and _STATM.exists()

# serialised indexes are per version
_OUTLINES_VERSION = importlib.metadata.version("outlines-core")

FINISHED = -1  # the state after EOS: nothing is legal any more

# outlines-core (0.2.x) drops every transition from an accepting state into a non-accepting one:
# `(ab)*` cannot continue "ab" with "a", `[0-9]+(,[0-9]+)*` cannot write "1,2". So the Index is
# built for `(?:R)\x00` instead: R's complete texts are then non-accepting and keep all their
# transitions, and "R is complete here" is read off as "the NUL terminator leads to the final
# state". The terminator is never legal itself: generated text never contains NUL.
TERMINATOR = b"\x00"


class Constraint:
    """A token automaton: ``step``, ``legal_prefix``, ``mask``, ``forced``, ``accepting``."""

    def __init__(self, index: Index, vocab: TokenVocabulary, vocab_size: int, regex: str):
        self.index, self.vocab, self.vocab_size, self.regex = index, vocab, vocab_size, regex
        self.eos_id = vocab.eos_id
        if TERMINATOR not in vocab.token_bytes:
            raise ConstraintError(
                "the tokenizer has no single-byte NUL token, which the compiler "
                "needs as its end-of-match terminator: use a byte-level BPE or a "
                "byte-fallback SentencePiece tokenizer."
            )
        self.terminator = vocab.token_bytes.index(TERMINATOR)
        self.initial_state: int = index.get_initial_state()
        self._allowed: dict[int, np.ndarray] = {}
        self._forced_bytes: dict[int, int | None] = {}
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._byte_ids = {b[0]: i for i, b in enumerate(vocab.token_bytes) if b and len(b) == 1}

    def allowed(self, state: int) -> list[int]:
        """Legal token ids in ``state`` (EOS included iff accepting)."""
        return self._legal(state).tolist()

    def _legal(self, state: int) -> np.ndarray:
        """Legal ids as an array, computed once per state (numpy: a free-text state has ~50k)."""
        if state not in self._allowed:
            if state == FINISHED:  # only EOS "continues": a harmless row for drafts ending in EOS
                ids = np.array([self.eos_id])
            else:
                ids = np.array(self.index.get_allowed_tokens(state), dtype=np.int64)
                ids = ids[(ids < self.vocab_size) & (ids != self.terminator) & (ids != self.eos_id)]
                if self.accepting(state):
                    ids = np.append(ids, self.eos_id)
            self._allowed[state] = ids
        return self._allowed[state]

    def step(self, state: int, token: int) -> int | None:
        """The state after ``token``, ``FINISHED`` after a legal EOS, ``None`` if illegal."""
        if state == FINISHED:
            return None
        if token == self.eos_id:
            return FINISHED if self.accepting(state) else None
        return None if token == self.terminator else self.index.get_next_state(state, token)

    def legal_prefix(self, state: int, tokens: list[int]) -> int:
        """How many leading ``tokens`` the automaton accepts from ``state``."""
        for n, token in enumerate(tokens):
            state = self.step(state, token)
            if state is None:
                return n
        return len(tokens)

    def accepting(self, state: int) -> bool:
        """True iff the text so far is a complete match (EOS is legal here)."""
        if state == FINISHED:
            return False
        after = self.index.get_next_state(state, self.terminator)
        return after is not None and self.index.is_final_state(after)

    def forced(self, state: int) -> int | None:
        """The only legal token, if exactly one (its probability is 1 under any policy)."""
        legal = self._legal(state)
        return int(legal[0]) if len(legal) == 1 else None

    def forced_text(self, state: int, limit: int = 64) -> bytes:
        """The bytes every continuation from ``state`` starts with: the grammar leaves exactly one
        choice for each (e.g. `","name":"` between two values). Stops where the match may end."""
        out = bytearray()
        while len(out) < limit and (byte := self._forced_byte(state)) is not None:
            out.append(byte)
            state = self.step(state, self._byte_ids[byte])
        return bytes(out)

    def _forced_byte(self, state: int) -> int | None:
        """The only byte that may come next, if exactly one; computed once per state."""
        if state not in self._forced_bytes:
            legal = self._legal(state)
            first = (
                {self.vocab.token_bytes[i][0] for i in legal.tolist()}
                if len(legal) <= 256 and state != FINISHED and not self.accepting(state)
                else set()
            )  # free text (or the end): nothing forced, skip the scan
            self._forced_bytes[state] = first.pop() if len(first) == 1 else None
        return self._forced_bytes[state]

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

    def mask(self, state: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Boolean mask of legal ids, (V,) with V the model's logits width; cached per state."""
        device = torch.device(device)
        key = (state, device)
        if key not in self._masks:
            legal = self._legal(state)
            if not len(legal):
                raise ConstraintError(
                    f"state {state} has no legal token: the constraint cannot "
                    "be completed with this vocabulary."
                )
            m = np.zeros(self.vocab_size, dtype=bool)
            m[legal] = True  # numpy scatter: ~50x faster than torch index_put on CPU here
            self._masks[key] = torch.from_numpy(m).to(device)
        return self._masks[key]

    def masks(self, states: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """The masks of ``states`` stacked, (len(states), V) bool: a pass's legal tokens."""
        return torch.stack([self.mask(s, device) for s in states])

    def clear_caches(self) -> None:
        """Drop the per-state legal ids and masks (~50k entries per free-text state): a process
        that compiles many schemas and is done with this one frees them; they rebuild on use."""
        self._allowed.clear()
        self._forced_bytes.clear()
        self._masks.clear()

    def accepts_tokens(self, tokens: list[int]) -> bool:
        """True iff the tokens (optionally ending in EOS) form a complete accepted text."""
        state = self.initial_state
        for token in tokens:
            state = self.step(state, token)
            if state is None:
                return False
        return state == FINISHED or self.accepting(state)

    def accepts(self, text: str) -> bool:
        """True iff the automaton accepts this complete text (walked one byte token at a time,
        so no tokenization choice can hide an accept or a reject)."""
        data = text.encode()
        missing = {b for b in data if b not in self._byte_ids}
        if missing:
            raise ValueError(f"the vocabulary has no single-byte token for bytes {sorted(missing)}")
        return self.accepts_tokens([self._byte_ids[b] for b in data])


@cache
def _outlines_vocabulary(vocab: TokenVocabulary) -> Vocabulary:
    return Vocabulary(vocab.eos_id, vocab.outlines_map())


_compiled: dict[tuple[str, str, int], Constraint] = {}
_translated: dict[tuple[str, str], str] = {}


def translate_schema(schema: dict, whitespace: str = "", timeout_s: float | None = None) -> str:
    """``schema_to_regex`` under the compile bounds (or ``timeout_s``), memoised: translation
    alone can take minutes (a 100k-value enum, an enum candidate checked against a
    backtracking ``pattern``)."""
    try:
        key = (json.dumps(schema, sort_keys=True), whitespace)
    except (TypeError, ValueError) as e:  # sets, NaN keys, objects: not a JSON document
        raise ConstraintError(
            f"the schema is not plain JSON data ({e}): pass JSON values."
        ) from None
    if key not in _translated:
        _translated[key] = run_bounded(
            lambda: schema_to_regex(schema, whitespace), "translating the schema", timeout_s
        )
    return _translated[key]


def compile_regex(
    regex: str,
    vocab: TokenVocabulary,
    vocab_size: int,
    cache_dir: Path | None = None,
    timeout_s: float | None = None,
) -> Constraint:
    """Compile ``regex`` for this vocabulary; cached in memory and (if ``cache_dir``) on disk.
    The index build runs under the compile bounds, or ``timeout_s``."""
    key = (regex, vocab.fingerprint, vocab_size)
    if key not in _compiled:
        index = _load_or_build_index(regex, vocab, cache_dir, timeout_s)
        _compiled[key] = Constraint(index, vocab, vocab_size, regex)
    return _compiled[key]


def check_regex(regex: str, timeout_s: float = 2.0) -> None:
    """Raise ConstraintError now (before any model loads) if the compiler cannot handle
    ``regex`` (look-around, backreferences, ``\\b``...): built over the 256 single bytes, where
    such errors show in microseconds. A regex whose check runs past ``timeout_s`` is left to the
    real (bounded) compile."""
    vocab = Vocabulary(256, {bytes([b]): [b] for b in range(256)})
    try:
        _build_index(regex, lambda pattern: Index(pattern, vocab), timeout_s)
    except SchemaTooComplex:
        pass


def _build_index(regex: str, build, timeout_s: float | None = None) -> Index:
    """``build((?:regex)\\x00)`` (see TERMINATOR) under the compile bounds; a compiler error
    becomes a ConstraintError quoting ``regex`` as given."""
    pattern = f"(?:{regex})\\x00"
    # a small regex without repetition is a small finite language: not worth a fork (~70 ms)
    trivial = len(pattern) <= 1000 and not any(c in pattern for c in "*+{")
    try:
        return run_bounded(
            lambda: build(pattern), "compiling the constraint", 0 if trivial else timeout_s
        )
    except SchemaTooComplex:
        raise
    except Exception as e:
        shown = (
            repr(regex) if len(regex) <= 300 else f"{regex[:300]!r}... ({len(regex)} characters)"
        )
        raise ConstraintError(
            f"cannot compile the regex {shown}: {e}. The compiler supports no look-around, "
            "backreferences or \\b: rewrite the regex without them."
        ) from None


# A compiled Index on disk: this header line, then the sha256 of the payload (hex) on its own line,
# then outlines-core's own serialisation of the Index (plain bytes: never unpickled). An entry
# that does not verify (another format or library version, another key, a damaged or planted
# payload) is ignored, rebuilt and overwritten.
CACHE_FORMAT = 1


def _entry_header(key_digest: str) -> bytes:
    header = {"format": CACHE_FORMAT, "outlines_core": _OUTLINES_VERSION, "key": key_digest}
    return b"constrained_spec index " + json.dumps(header, sort_keys=True).encode() + b"\n"


def _read_entry(path: Path, key_digest: str) -> Index | None:
    """The cached Index at ``path`` if the entry verifies, else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    header = _entry_header(key_digest)
    checksum, _, payload = data[len(header) :].partition(b"\n")
    if not data.startswith(header) or checksum != hashlib.sha256(payload).hexdigest().encode():
        return None
    try:
        return Index.from_binary(payload)
    except Exception:  # bincode refuses malformed bytes; it never runs code
        return None


def _write_entry(path: Path, key_digest: str, index: Index) -> None:
    """Store ``index`` atomically; a cache that cannot be written is a warning, never an error."""
    rebuild, args = index.__reduce__()  # (Index.from_binary, (bytes,)): outlines-core's format
    if rebuild != Index.from_binary or not (len(args) == 1 and isinstance(args[0], bytes)):
        _warn_once(f"outlines-core {_OUTLINES_VERSION} serialises an Index differently: not cached")
        return
    payload = args[0]
    checksum = hashlib.sha256(payload).hexdigest().encode()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(_entry_header(key_digest) + checksum + b"\n" + payload)
        os.replace(tmp, path)  # atomic: a crash never leaves a half-written entry
        tmp = None
    except OSError as e:  # full disk, read-only folder, a file where the folder should be
        warnings.warn(
            f"could not write the compile cache entry {path} ({e}); the constraint was compiled "
            "and is used, only not cached on disk. Set CONSTRAINED_SPEC_CACHE to a writable "
            "folder to cache it.",
            RuntimeWarning,
            stacklevel=4,
        )
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _load_or_build_index(
    regex: str, vocab: TokenVocabulary, cache_dir: Path | None, timeout_s: float | None = None
) -> Index:
    path = None
    if cache_dir is not None:
        key = f"{_OUTLINES_VERSION}\0{vocab.fingerprint}\0{regex}"
        key_digest = hashlib.sha256(key.encode()).hexdigest()
        path = Path(cache_dir) / "constraints" / f"{key_digest[:24]}.index"
        index = _read_entry(path, key_digest)
        if index is not None:
            return index
    outlines_vocab = _outlines_vocabulary(vocab)  # built here, shared with the child by fork
    index = _build_index(regex, lambda pattern: Index(pattern, outlines_vocab), timeout_s)
    if path is not None:
        _write_entry(path, key_digest, index)
    return index


# The Index build runs in native code: no Python signal can stop it, and it may take minutes or
# tens of GB. So it runs in a forked child with a wall-clock limit and an address-space limit.
# CONSTRAINED_SPEC_COMPILE_TIMEOUT (seconds) / CONSTRAINED_SPEC_COMPILE_MEMORY_GB set the limits;
# 0 for either runs the build in-process without any bound.
DEFAULT_COMPILE_TIMEOUT_S = 60.0
DEFAULT_COMPILE_MEMORY_GB = 8.0


# engine="auto" gives the regex engine this long (translation and index build together) for a
# schema llguidance cannot compile: a request, or a server's next ones, never waits a minute on
# it. CONSTRAINED_SPEC_FALLBACK_TIMEOUT (seconds; 0 = only the compile bounds above) sets it.
DEFAULT_FALLBACK_TIMEOUT_S = 2.0


def compile_limits() -> tuple[float, float]:
    """(timeout in s, memory in GB) from the environment; SettingError names a bad value."""
    return (
        setting("CONSTRAINED_SPEC_COMPILE_TIMEOUT", DEFAULT_COMPILE_TIMEOUT_S),
        setting("CONSTRAINED_SPEC_COMPILE_MEMORY_GB", DEFAULT_COMPILE_MEMORY_GB),
    )


def fallback_timeout() -> float:
    """Seconds engine="auto" gives the regex engine (0: the compile bounds alone)."""
    return setting("CONSTRAINED_SPEC_FALLBACK_TIMEOUT", DEFAULT_FALLBACK_TIMEOUT_S)


def setting(name: str, default: float, zero: str = "no limit") -> float:
    """A limit from the environment (``zero``: what 0 means); SettingError names a bad value."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise SettingError(
            f"{name}={text!r} is not a limit: set a finite number >= 0 (0 = {zero}), "
            f"or unset it for the default {default:g}."
        )
    return value


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def run_bounded(fn, what: str, timeout_s: float | None = None, memory_gb: float | None = None):
    """``fn()`` in a forked child with a time and memory bound; its (picklable) result.
    Raises SchemaTooComplex naming the exceeded limit; re-raises the child's own errors."""
    env_timeout, env_memory = compile_limits()
    timeout_s = env_timeout if timeout_s is None else timeout_s
    memory_gb = env_memory if memory_gb is None else memory_gb
    if timeout_s <= 0 or memory_gb <= 0:
        return fn()
    if "fork" not in mp.get_all_start_methods():  # e.g. Windows: no child shares our state
        _warn_once(
            "this platform cannot fork, so compiling runs without its time and memory bounds "
            "(CONSTRAINED_SPEC_COMPILE_TIMEOUT / _MEMORY_GB): a huge schema may run long."
        )
        return fn()
    if not MEMORY_BOUND:
        _warn_once("no `resource` or /proc here: compiling is bounded in time, not in memory.")
    parent, child = mp.get_context("fork").Pipe(duplex=False)
    proc = mp.get_context("fork").Process(target=_child, args=(fn, child, memory_gb), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise SchemaTooComplex(
                f"{what} took longer than {timeout_s:g} s. Simplify the schema (fewer optional "
                "properties, smaller maxLength/maxItems, shallower nesting) or raise the limit "
                "with CONSTRAINED_SPEC_COMPILE_TIMEOUT=<seconds> (0 = no limit).",
                timed_out=True,
            )
        status, payload = pickle.loads(parent.recv_bytes())
    except EOFError:  # the child died without answering: killed for memory, or aborted
        raise SchemaTooComplex(
            f"{what} ran out of its {memory_gb:g} GB memory limit. Simplify the schema or "
            "raise the limit with CONSTRAINED_SPEC_COMPILE_MEMORY_GB=<GB> (0 = no limit)."
        ) from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        parent.close()
    if status == "memory":
        raise SchemaTooComplex(
            f"{what} ran out of its {memory_gb:g} GB memory limit. Simplify "
            "the schema or raise CONSTRAINED_SPEC_COMPILE_MEMORY_GB."
        )
    if status == "error":
        raise payload
    return payload


def _child(fn, conn, memory_gb: float) -> None:
    # RLIMIT_AS counts the address space inherited from the parent too: allow that plus the limit.
    if MEMORY_BOUND:
        inherited = int(_STATM.read_text().split()[0]) * resource.getpagesize()
        limit = inherited + int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        result = ("ok", fn())
    except MemoryError:
        result = ("memory", None)
    except Exception as e:
        result = ("error", e if _picklable(e) else ConstraintError(str(e)))
    try:
        conn.send_bytes(pickle.dumps(result))
    except MemoryError:
        conn.send_bytes(pickle.dumps(("memory", None)))
    conn.close()
    os._exit(0)  # skip atexit handlers and finalizers inherited from the parent


def _picklable(e: Exception) -> bool:
    try:
        pickle.loads(pickle.dumps(e))
        return True
    except Exception:
        return False
