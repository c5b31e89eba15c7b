"""Issue 18, one test per item: the compile cache runs no code and verifies what it reads, no
``$ref`` is fetched, output cut at max_new_tokens is reported, a shared Generator is safe under
threads, translation is bounded, cache write failures are warnings, bad input is a documented
error before any model work, and the library imports and degrades where POSIX pieces are missing.
"""

import errno
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from constrained_spec import cli, compile, models, testing
from constrained_spec.decode import Generator
from constrained_spec.errors import (
    ConstraintError,
    GenerationInputError,
    SchemaTooComplex,
    SettingError,
    UnsupportedSchemaError,
)
from constrained_spec.schema import load_schema, schema_to_regex
from constrained_spec.vocab import token_vocabulary

ROOT = Path(__file__).resolve().parent.parent
REGEX = "[a-z]{1,5}"


@pytest.fixture
def vocab(tiny_tokenizer):
    return token_vocabulary(tiny_tokenizer)


@pytest.fixture
def fresh(monkeypatch):
    """Empty in-memory compile memos, so that each compile reads the disk cache again."""
    monkeypatch.setattr(compile, "_compiled", {})
    monkeypatch.setattr(compile, "_translated", {}, raising=False)  # (absent before issue 18)


def cached_entry(cache: Path) -> Path:
    (entry,) = (cache / "constraints").glob("*.index")
    return entry


def automaton(constraint) -> dict:
    return constraint.index.get_transitions()


# ---------------------------------------------------------------- 1, 3: the compile cache


class _Planted:
    """A pickle whose loading runs code (here: writes a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_a_planted_pickle_in_the_cache_is_never_run(vocab, tiny_tokenizer, tmp_path, fresh):
    import pickle

    reference = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), tmp_path)
    entry = cached_entry(tmp_path)
    good = entry.read_bytes()
    marker = tmp_path / "marker"
    entry.write_bytes(pickle.dumps(_Planted(marker)))  # planted where the next compile looks
    compile._compiled.clear()

    constraint = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), tmp_path)
    assert not marker.exists()
    assert automaton(constraint) == automaton(reference)  # recompiled ...
    assert entry.read_bytes() == good  # ... and overwritten


def test_every_bit_flip_in_a_cache_entry_is_caught(vocab, tiny_tokenizer, tmp_path, fresh):
    reference = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), tmp_path)
    entry = cached_entry(tmp_path)
    good = entry.read_bytes()
    assert good.startswith(b"constrained_spec index ")
    for i in range(30):
        bit = (i * 7919 * 8 + i) % (len(good) * 8)  # spread over header, checksum and payload
        damaged = bytearray(good)
        damaged[bit // 8] ^= 1 << (bit % 8)
        entry.write_bytes(bytes(damaged))
        compile._compiled.clear()
        constraint = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), tmp_path)
        assert automaton(constraint) == automaton(reference), f"bit {bit}"
        assert entry.read_bytes() == good, f"bit {bit}: not rewritten"
        assert not constraint.accepts("elines")


def test_an_entry_for_another_key_is_not_used(vocab, tiny_tokenizer, tmp_path, fresh):
    compile.compile_regex("[a-z]", vocab, len(tiny_tokenizer), tmp_path)
    other = cached_entry(tmp_path)
    compile.compile_regex("[0-9]", vocab, len(tiny_tokenizer), tmp_path / "x")
    entry = cached_entry(tmp_path / "x")
    entry.write_bytes(other.read_bytes())  # a valid entry, under the wrong name
    compile._compiled.clear()
    assert compile.compile_regex("[0-9]", vocab, len(tiny_tokenizer), tmp_path / "x").accepts("7")


# ---------------------------------------------------------------- 7: cache write failures


def test_a_cache_path_that_is_a_file_is_a_warning(vocab, tiny_tokenizer, tmp_path, fresh):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="could not write the compile cache"):
        constraint = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), blocker)
    assert constraint.accepts("abc")


def test_a_full_disk_is_a_warning_and_leaves_no_temp_file(
    vocab, tiny_tokenizer, tmp_path, fresh, monkeypatch
):
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd, mode):
            self.f = real_fdopen(fd, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:10])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(compile.os, "fdopen", Full)
    with pytest.warns(RuntimeWarning, match="No space left"):
        constraint = compile.compile_regex(REGEX, vocab, len(tiny_tokenizer), tmp_path)
    assert constraint.accepts("abc")
    assert list((tmp_path / "constraints").iterdir()) == []


# ---------------------------------------------------------------- 2: no $ref is fetched


@pytest.fixture
def web_server():
    """A local HTTP server that serves a permissive schema and counts the requests."""
    requests = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            body = b'{"type": "integer"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", requests
    server.shutdown()


def test_remote_refs_are_refused_by_name_and_never_fetched(web_server):
    url, requests = web_server
    for schema in (
        {"enum": [1, 7], "not": {"$ref": f"{url}/x.json"}},
        {"type": "object", "propertyNames": {"$ref": f"{url}/x.json"}},
        {"$ref": f"{url}/x.json#/definitions/a"},
    ):
        with pytest.raises(UnsupportedSchemaError, match="never fetched"):
            schema_to_regex(schema)
    # a local-looking ref under a nested $id still names a remote document: the registry refuses
    nested = {"enum": [1, 7], "not": {"$id": f"{url}/", "$ref": "#/definitions/a"}}
    try:
        schema_to_regex(nested)
    except ConstraintError:
        pass
    assert requests == []


def test_the_cli_refuses_a_remote_ref_before_the_model(web_server, no_model_load, capsys):
    url, requests = web_server
    schema = json.dumps({"type": "object", "propertyNames": {"$ref": f"{url}/x.json"}})
    assert cli.main(["generate", "--schema", schema, "hi"]) == cli.EXIT_USAGE
    assert "never fetched" in capsys.readouterr().err
    assert requests == []


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr(Generator, "from_pretrained", classmethod(refuse))


# ---------------------------------------------------------------- 4: output cut at max_new_tokens


@pytest.fixture
def tiny_cli(monkeypatch, tiny_target, tiny_tokenizer, tmp_path):
    gen = Generator(tiny_target, tiny_tokenizer, cache_dir=tmp_path)
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: gen))


@pytest.mark.parametrize("partial", [False, True])
def test_the_cli_exits_3_when_cut_at_max_new_tokens(tiny_cli, capsys, partial):
    args = [
        "generate",
        "--raw-prompt",
        "--schema",
        json.dumps(testing.PERSON),
        "--max-new-tokens",
        "3",
    ]
    code = cli.main(args + ["--seed", "0"] + (["--partial"] if partial else []) + ["hi"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_INCOMPLETE == 3
    assert err.startswith("error: stopped at --max-new-tokens 3") and err.count("\n") == 1, err
    if partial:
        assert out.startswith('{"') and out.endswith("\n")
    else:
        assert out == ""


def test_the_cli_exits_0_when_complete(tiny_cli, capsys):
    assert cli.main(["generate", "--raw-prompt", "--regex", "(yes|no)", "--seed", "0", "hi"]) == 0
    assert capsys.readouterr().out in ("yes\n", "no\n")


# ---------------------------------------------------------------- 5: one Generator, many threads


PROMPTS = ["yes no", "abba", '{"name":', "[1, 2", "Zoë", "null false"]


def shared_generator(tiny_target, tiny_tokenizer, tmp_path):
    # the head drafter keeps per-request state (its features and KV cache) on the shared object
    return Generator(
        tiny_target, tiny_tokenizer, draft=testing.random_head(tiny_target), cache_dir=tmp_path
    )


def request(gen, i: int):
    r = gen.generate(
        PROMPTS[i % len(PROMPTS)],
        schema=testing.PERSON,
        max_new_tokens=40,
        seed=i,
        num_draft_tokens=3,
    )
    return r.token_ids


@pytest.mark.parametrize("threads, per_thread", [(2, 3), (4, 3)])
def test_a_generator_shared_by_threads_gives_the_serial_outputs(
    tiny_target, tiny_tokenizer, tmp_path, threads, per_thread
):
    gen = shared_generator(tiny_target, tiny_tokenizer, tmp_path)
    n = threads * per_thread
    serial = [request(gen, i) for i in range(n)]
    results, errors = [None] * n, []

    def worker(t):
        try:
            for j in range(per_thread):
                i = t * per_thread + j
                results[i] = request(gen, i)
        except Exception as e:  # a crash in a thread must fail the test, not vanish
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert errors == []
    assert results == serial


# ---------------------------------------------------------------- 6: translation is bounded


def test_schema_translation_runs_under_the_compile_timeout(monkeypatch, fresh):
    monkeypatch.setenv("CONSTRAINED_SPEC_COMPILE_TIMEOUT", "1")
    # jsonschema checks the enum candidate with Python's re: 2^27 backtracking steps (~5 s)
    schema = {"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 27 + "!"]}
    t0 = time.perf_counter()
    with pytest.raises(SchemaTooComplex, match="translating the schema took longer than 1 s"):
        compile.translate_schema(schema)
    assert time.perf_counter() - t0 < 30  # generous: only "it was stopped", not a timing


def test_translation_is_memoised(monkeypatch, fresh):
    calls = []
    monkeypatch.setattr(compile, "schema_to_regex", lambda s, ws: calls.append(s) or "x")
    monkeypatch.setenv("CONSTRAINED_SPEC_COMPILE_TIMEOUT", "0")  # in-process: calls is seen
    compile.translate_schema({"type": "integer", "minimum": 1})
    compile.translate_schema({"minimum": 1, "type": "integer"})  # the same schema
    assert len(calls) == 1


# ---------------------------------------------------------------- 8: clear errors for bad input


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_schemas_are_constraint_errors(tmp_path):
    with pytest.raises(ConstraintError, match="nested more than"):
        schema_to_regex(nested(300))
    with pytest.raises(ConstraintError, match="nested more than"):
        load_schema("[" * 1200 + "]" * 1200)
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"description": "café"}'.encode("latin-1"))
    with pytest.raises(ConstraintError, match="not UTF-8"):
        load_schema(str(latin1))
    long_inline = "\ufeff" + json.dumps({"type": "string", "description": "x" * 300})
    assert load_schema(long_inline)["type"] == "string"
    with pytest.raises(ConstraintError, match="does not exist"):
        load_schema("x" * 5000)  # a file name too long for the OS: still "no such file"


@pytest.fixture
def gen(tiny_target, tiny_tokenizer, tmp_path):
    return Generator(tiny_target, tiny_tokenizer, cache_dir=tmp_path)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": float("inf")}, "temperature=inf"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": 1e-40}, "greedy in effect"),
        ({"seed": 2**64}, "seed="),
        ({"seed": -1}, "seed="),
        ({"prompt": [{"role": "user"}]}, "chat message 0"),
        ({"prompt": [{"role": "user", "content": None}]}, "'content' string"),
    ],
)
def test_bad_generate_arguments_are_generation_input_errors(gen, kwargs, message):
    kwargs = {"prompt": "hi", "regex": "(yes|no)", **kwargs}
    with pytest.raises(GenerationInputError, match=message):
        gen.generate(kwargs.pop("prompt"), **kwargs)


def test_temperature_at_the_minimum_samples(gen):
    r = gen.generate("hi", regex="(yes|no)", temperature=1e-4, seed=2**64 - 1)
    assert r.text in ("yes", "no")


@pytest.mark.parametrize("value", ["inf", "abc", "-1", "nan"])
def test_a_bad_compile_limit_setting_is_a_setting_error(monkeypatch, value, fresh):
    monkeypatch.setenv("CONSTRAINED_SPEC_COMPILE_TIMEOUT", value)
    with pytest.raises(SettingError, match="CONSTRAINED_SPEC_COMPILE_TIMEOUT"):
        compile.compile_limits()
    with pytest.raises(SettingError):
        compile.translate_schema({"type": "integer"})


BAD_CLI = [
    (["--schema", json.dumps(nested(300))], "nested more than"),
    (["--schema", "[" * 1200 + "]" * 1200], "nested more than"),
    (["--schema", "LATIN1"], "not UTF-8"),
    (["--regex", "a", "--temperature", "inf"], "--temperature inf must be 0"),
    (["--regex", "a", "--temperature", "1e-40"], "--temperature 1e-40 must be 0"),
    (["--regex", "a", "--seed", str(2**64)], "--seed 18446744073709551616 must be in"),
    (["--regex", "(?<=a)b"], "cannot compile the regex '(?<=a)b'"),
    (["--regex", r"\bfoo"], "cannot compile the regex '\\\\bfoo'"),
]


@pytest.mark.parametrize("args, message", BAD_CLI, ids=[m for _, m in BAD_CLI])
def test_bad_cli_input_exits_2_before_the_model(args, message, no_model_load, tmp_path, capsys):
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"description": "café"}'.encode("latin-1"))
    args = [str(latin1) if a == "LATIN1" else a for a in args]
    code = cli.main(["generate", *args, "hi"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["inf", "abc"])
def test_a_bad_compile_limit_setting_exits_2(monkeypatch, value, no_model_load, capsys):
    monkeypatch.setenv("CONSTRAINED_SPEC_COMPILE_TIMEOUT", value)
    assert cli.main(["generate", "--regex", "a+", "hi"]) == cli.EXIT_USAGE
    assert "CONSTRAINED_SPEC_COMPILE_TIMEOUT" in capsys.readouterr().err


# ---------------------------------------------------------------- 9: the regex, quoted exactly


def test_a_regex_the_compiler_refuses_is_quoted_exactly(vocab, tiny_tokenizer, fresh):
    with pytest.raises(ConstraintError, match=r"cannot compile the regex '\(\?<=a\)b'"):
        compile.check_regex("(?<=a)b")
    with pytest.raises(ConstraintError, match=r"cannot compile the regex '\(a\)\\\\1'"):
        compile.compile_regex(r"(a)\1", vocab, len(tiny_tokenizer), None)
    compile.check_regex("[a-z]+@[a-z]+")  # a regex the compiler handles passes


# ---------------------------------------------------------------- 10: one cache root


def test_the_cache_root_expands_home_and_ignores_empty(monkeypatch, tmp_path, tiny_target):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", "~/x")
    assert models.cache_dir() == tmp_path / "x"
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", "")
    assert models.cache_dir() == tmp_path / ".cache" / "constrained_spec"
    assert models.cache_dir("~/y") == tmp_path / "y"
    assert models.cache_dir("") == tmp_path / ".cache" / "constrained_spec"


def test_a_generator_uses_the_cache_root_helper(monkeypatch, tmp_path, tiny_target, tiny_tokenizer):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Generator(tiny_target, tiny_tokenizer, cache_dir="~/y").cache_dir == tmp_path / "y"
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", "~/z")
    assert Generator(tiny_target, tiny_tokenizer).cache_dir == tmp_path / "z"


# ---------------------------------------------------------------- 11: no resource, no fork


def test_the_package_imports_without_resource():
    code = (
        # psutil (under transformers) needs `resource` on Linux only: import it first
        "import sys, warnings, psutil, transformers.generation\n"
        "sys.modules['resource'] = None\n"  # what `import resource` finds on Windows
        "import constrained_spec, constrained_spec.cli, constrained_spec.compile as c\n"
        "assert c.resource is None and not c.MEMORY_BOUND\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    print(c.run_bounded(lambda: 6 * 7, 'answering', timeout_s=10, memory_gb=1))\n"
        "print([str(w.message) for w in seen])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    answer, warned = out.stdout.splitlines()
    assert answer == "42"
    assert "bounded in time, not in memory" in warned  # it says which bound is missing


def test_without_fork_the_unbounded_compile_warns_once(monkeypatch):
    monkeypatch.setattr(compile.mp, "get_all_start_methods", lambda: ["spawn"])
    monkeypatch.setattr(compile, "_warned", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert compile.run_bounded(lambda: 1, "one", timeout_s=5, memory_gb=1) == 1
        assert compile.run_bounded(lambda: 2, "two", timeout_s=5, memory_gb=1) == 2
    assert [str(w.message)[:40] for w in seen] == ["this platform cannot fork, so compiling "]


# ---------------------------------------------------------------- 12: an unknown hub id, offline


def test_the_hub_probe_sees_an_unreachable_endpoint(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    assert models.hub_offline()
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # behind a proxy: no verdict
    assert not models.hub_offline()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert models.hub_offline()


def test_an_unknown_hub_id_offline_reads_only_the_local_cache(monkeypatch):
    monkeypatch.setattr(models, "hub_offline", lambda: True)
    seen = []

    def from_pretrained(name, dtype, local_only=False):
        seen.append(local_only)
        raise OSError(f"{name} is not in the local cache")

    monkeypatch.setattr(models, "_from_pretrained", from_pretrained)
    with pytest.raises(ValueError, match="hub is unreachable"):
        models.load_model("nobody/no-such-model", weights="float")
    assert seen == [True]


def test_a_non_string_schema_uri_is_a_constraint_error():  # found by tests/test_fuzz.py
    with pytest.raises(ConstraintError, match=r"\$schema is \{"):
        schema_to_regex({"$schema": {"type": "string"}, "type": "integer"})


def test_enum_candidates_are_not_checked_against_their_own_enum(monkeypatch):
    """Each candidate is checked against the other keywords only: linear, not quadratic."""
    from constrained_spec.schema.context import Context

    checked = []
    real = Context.valid
    monkeypatch.setattr(Context, "valid", lambda self, v, s: checked.append(s) or real(self, v, s))
    regex = schema_to_regex({"enum": [f"v{i}" for i in range(50)], "maxLength": 2, "const": "v7"})
    assert regex == '"v7"'  # maxLength and const still apply
    assert len(checked) == 50 and all("enum" not in s for ss in checked for s in ss)


def test_a_not_excluded_by_type_stays_excluded_when_a_double_negation_adds_types(tiny_tokenizer):
    """Found by benchmarks/fuzz.py (seed 706): `true` fails the schema (the anyOf's enum matches
    it, so the `not` fails), yet the automaton accepted it: the first branch was dropped as
    "rejects every type we emit" (arrays, from minItems), then the `$ref` branch's double
    negation brought the enum, and booleans, in."""
    import jsonschema

    schema = {"not": {"anyOf": [{"enum": [True]}, {"$ref": "#"}]}, "minItems": 1}
    assert not jsonschema.Draft202012Validator(schema).is_valid(True)
    vocab = token_vocabulary(tiny_tokenizer)
    try:
        constraint = compile.compile_regex(schema_to_regex(schema), vocab, len(tiny_tokenizer))
    except ConstraintError:
        return  # refusing is sound too
    assert not constraint.accepts("true")


def test_boolean_schemas_are_any_value_or_refused_as_unsatisfiable(gen, tmp_path):
    """JSON Schema's boolean schemas: true takes any JSON value (as {}), false none; as a
    Python value, as JSON text and as a file, false refused before any model work."""
    path = tmp_path / "any.json"
    path.write_text("true\n")
    for true in (True, "true", " true ", str(path)):
        assert load_schema(true) == {}
        c = gen.compile(schema=true)
        assert all(c.accepts(text) for text in ('[1,{"a":null}]', '"x"', "-2.5e3", "false"))
        assert not c.accepts("[1,")
    path.write_text("false")
    for false in (False, "false", str(path)):
        with pytest.raises(ConstraintError, match="unsatisfiable"):
            gen.generate("hi", schema=false, max_new_tokens=4)
