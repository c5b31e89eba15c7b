"""Every shipped grammar compiles and accepts / rejects what its description says, and ships."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from constrained_spec.constraints import grammars
from constrained_spec.constraints.engine import compile_constraint
from constrained_spec.constraints.grammars import grammar_names, load_grammar
from constrained_spec.constraints.vocabulary import token_vocabulary
from constrained_spec.errors import ConstraintError

# name: (accepted texts, rejected texts). Every grammar file must have an entry here.
EXAMPLES = {
    "iso-date": (
        ["2024-02-29", "1999-12-31", "2025-04-30", "0001-01-01"],
        [
            "2024-2-29",
            "2024-13-01",
            "2024-04-31",
            "2024-02-30",
            "2024-00-10",
            "24-01-01",
            "2024-01-01T00:00:00Z",
            "2024/01/01",
        ],
    ),
    "iso-datetime": (
        ["2024-02-29T23:59:59Z", "2024-01-01T00:00:00.123+05:30", "1999-12-31T12:00:00-08:00"],
        [
            "2024-01-01",
            "2024-01-01T24:00:00Z",
            "2024-01-01T12:00:00",
            "2024-01-01 12:00:00Z",
            "2024-01-01T12:60:00Z",
            "2024-01-01T12:00:00+5:30",
        ],
    ),
    "email": (
        ["alice@example.com", "first.last+tag@example-mail.co", "a_b%c@x-y.io"],
        [
            "alice",
            "alice@",
            "@example.com",
            "alice@example",
            "alice@@example.com",
            ".alice@example.com",
            "alice.@example.com",
            "alice@-example.com",
            "alice@example.c0m",
            "al ice@example.com",
        ],
    ),
    "uuid": (
        ["123e4567-e89b-12d3-a456-426614174000", "0190a1b2-c3d4-7e5f-8a6b-7c8d9e0f1a2b"],
        [
            "123e4567e89b12d3a456426614174000",
            "123E4567-E89B-12D3-A456-426614174000",
            "123e4567-e89b-02d3-a456-426614174000",
            "123e4567-e89b-12d3-c456-426614174000",
            "123e4567-e89b-12d3-a456-42661417400",
        ],
    ),
    "phone-e164": (
        ["+14155552671", "+442071838750", "+491234567"],
        [
            "14155552671",
            "+04155552671",
            "+1 415 555 2671",
            "+123456",
            "+1234567890123456",
            "+1-415-555-2671",
        ],
    ),
    "semver": (
        ["1.0.0", "0.1.2", "10.20.30"],
        ["1.0", "01.0.0", "1.0.0-", "1.0.0-01", "1.0.0+", "v1.0.0", "1.0.0-alpha..1"],
    ),
    "ipv4": (
        ["192.168.0.1", "0.0.0.0", "255.255.255.255", "10.1.20.199"],
        ["256.1.1.1", "1.1.1", "01.1.1.1", "1.1.1.1.1", "1.1.1.", "a.b.c.d"],
    ),
    "json-object": (
        [
            "{}",
            '{"a":1}',
            '{"name":"Zoë","tags":["x",2,null],"ok":true}',
            '{"a":{"b":-1.5e3,"c":"\\u00e9\\n"}}',
            '{"a":[]}',
            '{"a":{}}',
        ],
        [
            "[]",
            "1",
            '"a"',
            '{"a":}',
            '{"a":1,}',
            "{a:1}",
            "{'a':1}",
            '{"a":1} ',
            '{"a": 1}',
            '{"a":{"b":{"c":1}}}',
            '{"a":[[1]]}',
            '{"a":"\n"}',
        ],
    ),
    "function-call": (
        [
            '{"name":"get_weather","arguments":{"city":"Paris","days":3}}',
            '{"name":"noop","arguments":{}}',
            '{"name":"db.query","arguments":{"filter":{"age":30},"limit":null}}',
        ],
        [
            '{"name":"get_weather"}',
            '{"arguments":{},"name":"f"}',
            '{"name":"1bad","arguments":{}}',
            '{"name":"f","arguments":[]}',
            '{"name":"f","arguments":{},"extra":1}',
            '{"name":"","arguments":{}}',
        ],
    ),
}

EXAMPLES |= {
    "arithmetic": (["1+2*(3-4)", "-(7)/2", "0", "((1))"], ["01", "1+", "()", "1 + 2"]),
    "json-depth3": (
        ['{"a":[1,{"b":null}]}', "[[[1]]]", '"x"', "{}", '{"k":"\\u00e9"}'],
        ["[[[[1]]]]", '{"a":1,}', "{a:1}", '{"a": 1}'],
    ),
    "sql-select": (
        [
            "SELECT * FROM users",
            "SELECT name, COUNT(*) FROM users AS u JOIN orders ON u.id = orders.user_id "
            "WHERE u.age >= 18 AND name LIKE 'A%' GROUP BY name ORDER BY name DESC LIMIT 10;",
            "SELECT a FROM t WHERE b IS NOT NULL",
        ],
        ["SELECT FROM t", "select * from t", "SELECT * FROM t LIMIT", "DROP TABLE t"],
    ),
    "tool-call": (
        ['<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'],
        [
            '<tool_call>{"name":"1x","arguments":{}}</tool_call>',
            '{"name":"f","arguments":{}}',
            '<tool_call>{"name":"f"}</tool_call>',
        ],
    ),
}

# Texts that continue past an accepting prefix ("1.0.0" → "1.0.0-alpha"): a complete match may
# go on (an automaton that dropped the transitions out of accepting states would stop there).
CONTINUED_MATCHES = {
    "semver": ["1.0.0-alpha.1", "1.0.0-0.3.7", "1.0.0+build.5", "2.0.0-rc.1+sha.e0f3a1"],
    "email": ["first.last@mail.example.co.uk", "bob@example.com.au"],
}


@pytest.fixture(scope="module")
def compiled(tiny_tokenizer):
    vocab, cache = token_vocabulary(tiny_tokenizer), {}

    def compile_grammar(name):
        if name not in cache:
            cache[name] = compile_constraint(vocab, len(tiny_tokenizer), **load_grammar(name))
        return cache[name]

    return compile_grammar


def test_every_grammar_has_examples_and_a_description():
    names = grammar_names()
    assert set(names) == set(EXAMPLES), "add accept/reject examples for each grammar file"
    for name, description in names.items():
        assert description and "\n" not in description, name


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_grammar_accepts_and_rejects(compiled, name):
    constraint = compiled(name)
    accepted, rejected = EXAMPLES[name]
    assert [t for t in accepted if not constraint.accepts(t)] == []
    assert [t for t in rejected if constraint.accepts(t)] == []


@pytest.mark.parametrize("name, text", [(n, t) for n, ts in CONTINUED_MATCHES.items() for t in ts])
def test_grammar_accepts_continuations_of_accepting_prefixes(compiled, name, text):
    assert compiled(name).accepts(text)


def test_continued_examples_are_matched_by_the_regexes_themselves():
    for name, texts in CONTINUED_MATCHES.items():
        regex = load_grammar(name)["regex"]
        assert [t for t in texts if not re.fullmatch(regex, t)] == [], name


def test_unknown_grammar_lists_the_available_ones():
    with pytest.raises(ConstraintError, match="unknown grammar 'nope'.*iso-date"):
        load_grammar("nope")


def test_kinds():
    assert set(load_grammar("iso-date")) == {"regex"}
    assert load_grammar("function-call")["schema"]["required"] == ["name", "arguments"]


def test_missing_grammar_files_are_an_error_not_an_empty_list(monkeypatch, tmp_path):
    monkeypatch.setattr(grammars, "GRAMMAR_DIR", tmp_path / "grammars")
    with pytest.raises(FileNotFoundError, match="no grammar files in .*reinstall"):
        grammar_names()


def test_the_wheel_ships_every_grammar(tmp_path):
    """A non-editable install reads the grammars from the package: they must be in the wheel."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"  # a copy, so building leaves no build/ or egg-info in the checkout
    for folder in ("constrained_spec", "grammars"):
        shutil.copytree(
            root / folder,
            src / folder,
            ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"),
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("constrained_spec-*.whl")
    shipped = {
        Path(n).name
        for n in zipfile.ZipFile(wheel).namelist()
        if n.startswith("constrained_spec/grammars/")
    }
    assert shipped == {p.name for p in (root / "grammars").iterdir()}
    assert {n.rpartition(".")[0] for n in shipped} == set(grammar_names())
