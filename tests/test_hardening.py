"""Hostile and careless input, one test per item: no ``$ref`` is fetched, output cut at
max_new_tokens is reported, a shared Generator is safe under threads, bad input is a documented
error before any model work, one cache root, an unknown hub id offline fails fast.
"""

import http.server
import json
import threading

import jsonschema
import pytest

from constrained_spec import cli, testing
from constrained_spec.constraints import grammar_for, load_schema
from constrained_spec.errors import (
    ConstraintError,
    GenerationInputError,
    SettingError,
    UnsupportedSchemaError,
)
from constrained_spec.generator import Generator
from constrained_spec.model import machine, models

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
            grammar_for(schema=schema)
    # a local-looking ref under a nested $id still names a remote document: the registry refuses
    nested = {"enum": [1, 7], "not": {"$id": f"{url}/", "$ref": "#/definitions/a"}}
    try:
        grammar_for(schema=nested)
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
    gen = Generator(tiny_target, tiny_tokenizer)
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
        "--no-budget-mask",
    ]
    code = cli.main(args + ["--seed", "0"] + (["--partial"] if partial else []) + ["hi"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_INCOMPLETE == 3
    assert err.startswith("error: stopped at --max-new-tokens 3") and err.count("\n") == 1, err
    if partial:
        assert out.startswith('{"') and out.endswith("\n")
    else:
        assert out == ""


def test_the_cli_refuses_a_budget_below_the_shortest_output(tiny_cli, capsys):
    """With the budget mask (the default): exit 2 before any model work, naming both numbers
    and the ways out; one token more and the output is complete, made to finish in time."""
    args = ["generate", "--raw-prompt", "--schema", json.dumps(testing.PERSON), "--seed", "0"]
    code = cli.main(args + ["--max-new-tokens", "16", "hi"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE and out == "" and err.count("\n") == 1, err
    assert "--max-new-tokens 16 is below the 17 tokens" in err and "--no-budget-mask" in err
    assert cli.main(args + ["--max-new-tokens", "17", "--stats", "hi"]) == 0
    out, err = capsys.readouterr()
    jsonschema.validate(json.loads(out), testing.PERSON)
    assert "finish                  budget, 17 tokens" in err, err


def test_the_cli_exits_0_when_complete(tiny_cli, capsys):
    assert cli.main(["generate", "--raw-prompt", "--regex", "(yes|no)", "--seed", "0", "hi"]) == 0
    assert capsys.readouterr().out in ("yes\n", "no\n")


# ---------------------------------------------------------------- 5: one Generator, many threads


PROMPTS = ["yes no", "abba", '{"name":', "[1, 2", "Zoë", "null false"]


def shared_generator(tiny_target, tiny_tokenizer, tmp_path):
    # the head drafter keeps per-request state (its features and KV cache) on the shared object
    return Generator(tiny_target, tiny_tokenizer, draft=testing.random_head(tiny_target))


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


# ---------------------------------------------------------------- 8: clear errors for bad input


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_schemas_are_constraint_errors(tmp_path):
    with pytest.raises(ConstraintError, match="nested more than"):
        grammar_for(schema=nested(300))
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
    return Generator(tiny_target, tiny_tokenizer)


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


# ---------------------------------------------------------------- 10: one cache root


def test_the_cache_root_expands_home_and_ignores_empty(monkeypatch, tmp_path, tiny_target):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", "~/x")
    assert machine.cache_dir() == tmp_path / "x"
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", "")
    assert machine.cache_dir() == tmp_path / ".cache" / "constrained_spec"
    assert machine.cache_dir("~/y") == tmp_path / "y"
    assert machine.cache_dir("") == tmp_path / ".cache" / "constrained_spec"


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


def test_a_non_string_schema_uri_is_a_constraint_error():  # found by tests/test_fuzz.py
    with pytest.raises(ConstraintError, match=r"\$schema is \{"):
        grammar_for(schema={"$schema": {"type": "string"}, "type": "integer"})


@pytest.mark.parametrize("value", ["inf", "abc", "-1", "nan"])
def test_a_bad_setting_is_a_setting_error(monkeypatch, value):
    monkeypatch.setenv("CONSTRAINED_SPEC_PROMPT_CACHE_MB", value)
    with pytest.raises(SettingError, match="CONSTRAINED_SPEC_PROMPT_CACHE_MB"):
        machine.setting("CONSTRAINED_SPEC_PROMPT_CACHE_MB", 128.0)
