"""Every cache a server's engine keeps stays within its stated cap (docs/server.md, "Memory"):
a constraint's masks, bitmasks and matcher copies, the compiled constraints, and the trie of
states past which a fresh constraint is compiled."""

import platform
import random

import pytest

from constrained_spec.constraints import engine
from constrained_spec.constraints.vocabulary import token_vocabulary


def walk(constraint, steps: int, seed: int) -> int:
    """A random path of ``steps`` legal tokens, each state's mask asked for; the states made."""
    rng, state, made = random.Random(seed), constraint.initial_state, 0
    for _ in range(steps):
        constraint.mask(state)
        legal = [t for t in constraint._legal(state).tolist() if t != constraint.eos_id]
        if not legal:
            break
        state = constraint.step(state, rng.choice(legal))
        made += 1
    return made


def test_a_constraints_caches_stay_within_their_caps(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(engine, "MASK_CACHE", 8)
    monkeypatch.setattr(engine, "SNAPSHOTS", 4)
    monkeypatch.setattr(engine, "BOOL_MASKS", 3)
    vocab = token_vocabulary(tiny_tokenizer)
    c = engine.GuidanceConstraint(
        engine.regex_grammar("[a-z ]{0,500}"), vocab, len(vocab.token_bytes), "regex"
    )
    assert walk(c, 60, seed=0) == 60  # the subject: many more states than the caps
    assert len(c._masks) == 3 and len(c._bits) <= 8 and len(c._snapshots) <= 4
    assert len(c._parent) == 61  # the trie holds each state once: the root and the path


def test_the_bool_masks_of_every_compiled_constraint_fit_in_64_mb():
    # docs/server.md, "Memory": V bytes a mask at the built-in model's V = 49,152 (at 256 masks a
    # constraint, the soak's 20 busy schemas grew RSS by 46% over 10,000 requests)
    assert engine.COMPILED_CACHE * engine.BOOL_MASKS * 49_152 <= 64 << 20
    assert engine.BOOL_MASKS < engine.MASK_CACHE  # a bool mask is rebuilt from a kept bitmask


def test_compiled_constraints_are_kept_up_to_the_cap_and_renewed_past_max_states(
    tiny_tokenizer, monkeypatch
):
    monkeypatch.setattr(engine, "COMPILED_CACHE", 3)
    monkeypatch.setattr(engine, "_compiled", type(engine._compiled)())
    vocab = token_vocabulary(tiny_tokenizer)
    width = len(vocab.token_bytes)
    compiled = [
        engine.compile_grammar(engine.regex_grammar(f"x{i}[a-z]*"), vocab, width, "regex")
        for i in range(10)
    ]
    assert len(engine._compiled) == 3 and list(engine._compiled.values()) == compiled[-3:]
    grammar = engine.regex_grammar("[a-z ]{0,500}")
    first = engine.compile_grammar(grammar, vocab, width, "regex")
    assert engine.compile_grammar(grammar, vocab, width, "regex") is first  # cached
    monkeypatch.setattr(engine, "MAX_STATES", 20)
    walk(first, 30, seed=1)
    again = engine.compile_grammar(grammar, vocab, width, "regex")
    assert again is not first and len(again._parent) == 1, "the full trie was handed out again"


def test_the_server_gives_free_heap_back_on_glibc(monkeypatch):
    server = pytest.importorskip("constrained_spec.server")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    assert server._libc_trim is not None  # else the trim below would do nothing, unseen
    calls = []
    monkeypatch.setattr(server, "_libc_trim", calls.append)
    worker = server.Worker.__new__(server.Worker)  # no model thread: take() alone
    worker.jobs, worker.trimmed = server.queue.Queue(), 0.0
    worker.take(1, wait=False)
    worker.take(1, wait=False)  # within TRIM_EVERY_S of the first: not again
    assert calls == [0]
