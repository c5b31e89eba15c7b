"""The OpenAI-compatible server, driven by the real ``openai`` client against a real server
process (the default model, loaded once for this module) on a free local port."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

openai = pytest.importorskip("openai", reason="the server tests need the [test] extra (openai)")
pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi)")

from constrained_spec.server import ChatRequest, ServerConfig, plan  # noqa: E402
from constrained_spec.testing import server_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.real_model

KEY = "sk-test"
MAX_QUEUE = 16
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add_person", "parameters": PERSON}},
]
ENDLESS = "[a-z]{400}"  # no EOS before 400 letters: a request that runs until stopped
ASK = [{"role": "user", "content": "Extract the person: Alice is 30 years old."}]


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def server(request):
    """A server per --batch-size: requests one at a time (Generator.stream), or batched."""
    args = ["--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--max-tokens", "400"]
    args += ["--threads", "1"]  # the test process shares the cores (2 on CI)
    args += ["--batch-size", str(request.param)]
    args += ["--max-body-bytes", "65536", "--max-schema-bytes", "4096"]
    with server_process(*args) as url:
        yield url, request.param


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=300)


class Reply:
    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    def json(self):
        return json.loads(self.body)


def post(url: str, body, key: str = KEY, path: str = "/v1/chat/completions") -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


def wait_for(url: str, check, timeout_s: float = 60.0) -> dict:
    """Poll /health until ``check(body)`` holds (the server notices disconnects by polling)."""
    deadline = time.monotonic() + timeout_s
    while not check(body := health(url)):
        assert time.monotonic() < deadline, f"/health never satisfied the check: {body}"
        time.sleep(0.2)
    return body


# ---------------------------------------------------------------- completions


def test_json_schema_reply_validates_and_reports_speculation(client):
    r = client.chat.completions.create(
        model="any",
        messages=ASK,
        response_format=json_format(PERSON),
        temperature=0,
        max_tokens=48,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    speculation = r.usage.model_extra["speculation"]
    assert speculation["target_calls"] >= 1 and r.usage.completion_tokens >= 1
    assert speculation["accepted_drafts"] <= speculation["drafted_tokens"]


def test_stream_sends_the_same_text_as_a_plain_reply(client, server):
    kwargs = dict(model="any", messages=ASK, response_format=json_format(PERSON), temperature=0)
    plain = client.chat.completions.create(max_tokens=48, **kwargs).choices[0]
    chunks = list(client.chat.completions.create(max_tokens=48, stream=True, **kwargs))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1, "the reply came in one piece: nothing was streamed"
    assert "".join(pieces) == plain.message.content  # greedy: the same tokens
    assert [c.choices[0].finish_reason for c in chunks][-1] == plain.finish_reason == "stop"
    assert chunks[-1].usage.model_extra["speculation"]["target_calls"] >= 1
    jsonschema.validate(json.loads("".join(pieces)), PERSON)
    kept = health(server[0])["prompt_cache"]  # the same prompt again: all of it kept
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1 if kept else 0)


def test_sampled_replies_validate(server, client):
    """temperature 1 (OpenAI's default) with top_p and a seed. A batched request drafts with
    a fresh drafter, so its seed repeats the reply; one at a time, the drafter learns token
    habits across requests and the same seed need not repeat it (docs/server.md)."""
    texts, stopped = [], 0
    for seed in (0, 1, 1):
        r = client.chat.completions.create(
            model="any",
            messages=ASK,
            response_format=json_format(PERSON),
            seed=seed,
            top_p=0.9,
            max_tokens=40,
        )
        texts.append(r.choices[0].message.content)
        if r.choices[0].finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(texts[-1]), PERSON)
    assert stopped >= 1, "no sampled reply stopped: nothing was validated"
    if server[1] > 1:
        assert texts[1] == texts[2]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_call_arguments_follow_the_parameters(client, choice):
    tool_choice = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    r = client.chat.completions.create(
        model="any",
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=64,
    )
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    (call,) = choice_.message.tool_calls
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.function.name in parameters
    if choice == "named":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_replies_are_text_or_valid_calls(client, choice):
    """The SDK's default: the model answers in text or calls a tool; a call's arguments follow
    the tool's parameters (the default model mostly answers in text: both are checked)."""
    picked = {} if choice is None else {"tool_choice": choice}
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for question in ("What is the weather in Paris, in celsius?", "Add Bob, 41, please."):
        r = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": question}], tools=TOOLS,
            temperature=0, max_tokens=64, **picked,
        )  # fmt: skip
        reply = r.choices[0]
        assert reply.finish_reason in ("stop", "tool_calls", "length"), reply
        if reply.finish_reason == "tool_calls":
            for call in reply.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, parameters[call.function.name])
        else:
            assert reply.message.tool_calls is None and "<tool_call>" not in reply.message.content


def test_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS[:1],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    chunks = list(stream)
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"regex": "(yes|no), [0-9]{2}"}, lambda t: t[:3] in ("yes", "no,")),
        ({"grammar": "iso-date"}, lambda t: len(t) == 10 and t[4] == "-"),
        # a GBNF grammar (the llguidance engine); the model may write past max_tokens here
        ({"grammar": "arithmetic"}, lambda t: t and set(t) <= set("0123456789+-*/()")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_regex_grammar_and_json_object(client, extra, check):
    fmt = extra.get("response_format")  # the dict is shared by both servers: not popped
    kwargs = {"response_format": fmt} if fmt else {"extra_body": extra}
    r = client.chat.completions.create(
        model="any", messages=ASK, temperature=0, max_tokens=40, **kwargs
    )
    finish = r.choices[0].finish_reason
    assert finish == "stop" or (finish == "length" and "grammar" in extra), finish
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_a_schema_with_a_property_count_is_served(client):
    """minProperties on an object with optional properties: said as which are present
    (rewrite._property_counts); the server serves what the library compiles."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "minProperties": 2,
    }
    r = client.chat.completions.create(
        model="any", messages=ASK, temperature=0, max_tokens=60, response_format=json_format(schema)
    )
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["smollm2-135m-instruct"]


# ---------------------------------------------------------------- errors


def test_unsupported_schema_is_a_400_naming_the_keyword(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="any",
            messages=ASK,
            response_format=json_format({"type": "string", "format": "uri-template"}),
        )
    assert "uri-template" in str(e.value) and e.value.code == "unsupported_schema"


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"messages": ASK, "max_tokens": 10_000}, 400, "max_tokens_too_large"),
        ({"messages": ASK, "regex": "(a|b"}, 400, "invalid_regex"),
        ({"messages": ASK, "regex": "(?=a)a"}, 400, "invalid_regex"),
        ({"messages": ASK, "grammar": "nope"}, 400, "unknown_grammar"),
        ({"messages": ASK, "grammar": "/etc/hostname"}, 400, "unknown_grammar"),  # no paths
        (
            {"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"},
            400,
            "unsupported_tool_choice",
        ),
        (
            {"messages": ASK, "response_format": json_format({"enum": ["x" * 5000]})},
            400,
            "schema_too_large",
        ),
        ({"messages": ASK, "n": MAX_QUEUE + 1}, 400, "invalid_value"),
        ({"messages": ASK, "presence_penalty": 0.5}, 400, "unsupported"),
        ({"messages": ASK, "max_tokens": 0}, 400, "invalid_max_tokens"),
        ({"messages": ASK, "temperature": 3}, 400, "invalid_value"),
        ({"messages": "hi"}, 422, "invalid_request_body"),
        (b"{not json", 422, "invalid_request_body"),
        ({"messages": ASK, "pad": "x" * 70_000}, 413, "request_too_large"),
    ],
)
def test_bad_requests_get_their_own_error(server, body, status, code):
    reply = post(server[0], body)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error


def test_wrong_key_is_a_401(server):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="any", messages=ASK, max_tokens=4)


# ---------------------------------------------------------------- concurrency


def test_16_concurrent_clients_get_their_own_replies(server, client):
    """Each reply starts with its request's tag (4 tags: each new regex costs a compile), so a
    reply handed to a client with another tag shows; every reply id is distinct."""

    def ask(i: int):
        regex = f"request {i % 4}: [a-z]{{3,12}}"
        messages = [{"role": "user", "content": f"Name a fruit (request {i % 4})."}]
        kwargs = dict(model="any", messages=messages, max_tokens=8, extra_body={"regex": regex})
        if i % 2:  # half of them stream
            chunks = list(client.chat.completions.create(stream=True, seed=i, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            return i, chunks[0].id, text, chunks[-1].choices[0].finish_reason
        r = client.chat.completions.create(seed=i, **kwargs)
        return i, r.id, r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, range(16)))
    assert len({rid for _, rid, _, _ in replies}) == 16
    for i, _, text, finish in replies:
        assert text.startswith(f"request {i % 4}: "), (i, text)
        assert finish in ("stop", "length")
    wait_for(server[0], lambda h: h["queue"] == 0)


def test_a_client_leaving_mid_stream_stops_its_decoding(server, client):
    before = health(server[0])["cancelled"]
    stream = client.chat.completions.create(
        model="any", messages=ASK, max_tokens=400, stream=True, extra_body={"regex": ENDLESS}
    )
    chunks = iter(stream)
    received = [next(chunks) for _ in range(3)]
    assert received[-1].choices[0].finish_reason is None
    stream.close()
    after = wait_for(server[0], lambda h: h["cancelled"] > before and h["queue"] == 0)
    assert after["cancelled"] == before + 1
    # greedy: a sampled reply may end (EOS) within 4 tokens, and "length" is what is checked
    r = client.chat.completions.create(model="any", messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"  # the server goes on serving


def test_full_queue_is_a_429_and_leaving_clients_free_their_slots(server, client):
    url = server[0]
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"messages": ASK, "max_tokens": 400, "regex": ENDLESS}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_QUEUE)]
    try:
        for s in sockets:
            s.sendall(head + body)  # requests that would run for 400 tokens each
        wait_for(url, lambda h: h["queue"] == MAX_QUEUE)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="any", messages=ASK, max_tokens=4)
        assert e.value.code == "queue_full"
    finally:
        for s in sockets:
            s.close()  # the clients leave: the server must notice and free every slot
    wait_for(url, lambda h: h["queue"] == 0)
    r = client.chat.completions.create(model="any", messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- the request check alone


def test_serve_checks_its_flags_before_loading():
    from constrained_spec import cli

    assert cli.main(["serve", "--model", "no such model!"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--port", "0"]) == cli.EXIT_USAGE
    assert cli.main(["serve", "--threads", "0"]) == cli.EXIT_USAGE


def test_the_loop_guard_is_asked_for_and_off_by_default():
    assert plan(ChatRequest(messages=ASK, loop_guard=True), ServerConfig()).loop_guard
    assert not plan(ChatRequest(messages=ASK), ServerConfig()).loop_guard


def test_plan_builds_the_tool_envelope_and_preamble():
    req = ChatRequest(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0)
    p = plan(req, ServerConfig())
    assert (
        p.tool == ""
        and p.messages[0]["role"] == "system"
        and "get_weather" in p.messages[0]["content"]
    )
    assert p.temperature == 0 and p.max_tokens == ServerConfig().default_max_tokens


def test_the_load_benchmark_runs_as_a_user_runs_it(tmp_path):
    """benchmarks/serve.py load from the repository root (it starts its own server): every request
    answered to its own client, and the report written."""
    # room for the schema's shortest reply (the budget mask refuses less): about 15 tokens
    args = ["--clients", "1,2", "--requests", "1", "--max-tokens", "24", "--out", str(tmp_path)]
    load = [sys.executable, str(ROOT / "benchmarks" / "serve.py"), "load"]
    out = subprocess.run(
        [*load, *args, "--server-args=--threads 1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    levels = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert [lv["requests"] for lv in levels] == [1, 2]
    assert all(lv["lost"] == 0 and lv["mixed_up"] == 0 for lv in levels), levels
    text = (tmp_path / "report.md").read_text()
    assert "| 2 | 2 |" in text and "Goal: 2 clients ≥ 3× one client's throughput" in text
