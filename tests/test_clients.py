"""The server's OpenAI fields (stop, logprobs, n, seed) through the real ``openai`` client, on a
real HTTP server in this process (uvicorn in a thread) over a tiny model: quick enough to check
each field against the Python API token for token. Both ways of running requests: one at a
time, and batched."""

import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import jsonschema
import pytest
import torch

openai = pytest.importorskip("openai", reason="the client tests need the [test] extra (openai)")
uvicorn = pytest.importorskip("uvicorn", reason="the client tests need the [serve] extra")

from constrained_spec import Generator, testing  # noqa: E402
from constrained_spec.decoding.drafters import CompositeDrafter  # noqa: E402
from constrained_spec.server import OPEN, ChatRequest, ServerConfig, create_app, plan  # noqa: E402

FREE = "[a-z ]{0,40}"
ASK = [{"role": "user", "content": "hello"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK_WEATHER = [{"role": "user", "content": "weather?"}]
ASK_OTHER = [{"role": "user", "content": "abba yes no"}]
# How far the tiny model prefers to open a call after ASK_WEATHER's prompt (a logit): enough
# that most of its sampled replies call the tool and some replies to ASK_OTHER do not.
CALL_LOGIT = 9.0


def tiny_generator() -> Generator:
    """The tiny model with the call envelope's opening as one token of its own, and its LM head
    steered to open a call after ASK_WEATHER's prompt (a random model would almost never)."""
    tokenizer = testing.tiny_tokenizer(
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tokenizer.add_tokens([OPEN])
    model = testing.tiny_model(tokenizer, seed=0, max_positions=1024)  # the tools' preamble
    gen = Generator(model, tokenizer, draft=CompositeDrafter())
    prompt = gen.encode_prompt(
        plan(ChatRequest(messages=ASK_WEATHER, tools=TOOLS), CONFIG).messages
    )
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt])).last_hidden_state[0, -1]  # (d,)
        row = tokenizer.convert_tokens_to_ids(OPEN)
        model.lm_head.weight[row] = CALL_LOGIT * hidden / hidden.norm() ** 2
    return gen


CONFIG = ServerConfig(model="tiny", max_tokens=100, max_queue=8)


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def served(request):
    """(client, the server's Generator, its batch size) for a server on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = dataclasses.replace(CONFIG, batch_size=request.param)
    app = create_app(config, load=tiny_generator)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and app.state.worker.loaded.is_set()):
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
    )
    yield client, app.state.worker.gen, request.param
    server.should_exit = True
    thread.join(10)


def test_a_loading_server_answers_503_until_its_model_is_ready():
    """/health and completions answer 503 while the model loads (held here until released:
    a prepared model maps too fast for a real server to show it), then serve."""
    ready = threading.Event()

    def load():
        ready.wait(60)
        return tiny_generator()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(CONFIG, load=load)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps({"messages": ASK, "max_tokens": 5, "regex": FREE}).encode()

        def status(path: str, data: bytes | None = None) -> int:
            request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code

        assert status("/health") == 503 and status("/v1/chat/completions", body) == 503
        ready.set()
        deadline = time.monotonic() + 60
        while status("/health") != 200:
            assert time.monotonic() < deadline, "the model never finished loading"
            time.sleep(0.05)
        assert status("/v1/chat/completions", body) == 200
    finally:
        ready.set()
        server.should_exit = True
        thread.join(10)


def ask(client, **fields):
    fields.setdefault("max_tokens", 30)
    return client.chat.completions.create(
        model="tiny", messages=ASK, extra_body={"regex": FREE}, **fields
    )


def test_stop_ends_the_reply_before_the_stop_string(served):
    client, *_ = served
    whole = ask(client, temperature=0).choices[0].message.content
    stop = whole[9:11]
    assert len(stop) == 2 and whole.index(stop) > 0
    cut = ask(client, temperature=0, stop=[stop, "zzz"]).choices[0]
    assert cut.message.content == whole[: whole.index(stop)] and cut.finish_reason == "stop"
    streamed = ask(client, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content


def test_logprobs_are_the_python_apis(served):
    client, gen, batch_size = served
    temperature = 0.7 if batch_size > 1 else 0.0  # see test_n_choices_each_with_its_own_seed
    settings = dict(temperature=temperature, seed=5, logprobs=True, top_logprobs=2)
    reply = ask(client, **settings).choices[0]
    python = gen.generate(ASK, regex=FREE, max_new_tokens=30, **settings)
    entries = reply.logprobs.content
    assert reply.message.content == python.text
    assert "".join(e.token for e in entries) == python.text
    assert [e.logprob for e in entries] == pytest.approx([s.logprob for s in python.logprobs])
    assert all(1 <= len(e.top_logprobs) <= 2 for e in entries)
    assert ask(client, temperature=0).choices[0].logprobs is None


def test_n_choices_each_with_its_own_seed(served):
    """Choice i samples with seed + i. Batched, each row drafts with a fresh drafter, so the
    same seed repeats a reply; one at a time the lookup drafter has learnt from earlier
    requests and may consume the random stream differently (docs/server.md): greedy only."""
    client, _, batch_size = served
    temperature = 1.0 if batch_size > 1 else 0.0
    three = ask(client, n=3, seed=11, temperature=temperature)
    texts = [c.message.content for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len(set(texts)) == (3 if temperature else 1), texts
    assert texts == [
        ask(client, seed=11 + i, temperature=temperature).choices[0].message.content
        for i in range(3)
    ]
    streamed: dict[int, str] = {}
    for c in ask(client, n=3, seed=11, temperature=temperature, stream=True):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    assert three.usage.completion_tokens > ask(client, seed=11).usage.completion_tokens


@pytest.mark.parametrize(
    "fields, param, code",
    [
        (dict(stop=["a", "b", "c", "d", "e"]), "stop", "array_above_max_length"),
        (dict(stop=[""]), "stop", "invalid_value"),
        (dict(stop=""), "stop", "invalid_value"),
        (dict(top_logprobs=2), "top_logprobs", "invalid_value"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (dict(n=0), "n", "invalid_value"),
        (dict(n=9), "n", "invalid_value"),
    ],
)
def test_bad_fields_answer_400_naming_the_field(served, fields, param, code):
    client, *_ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, **fields)
    assert e.value.body["param"] == param and e.value.body["code"] == code


def test_a_reply_the_budget_shaped_is_complete_and_says_so(served):
    """A JSON reply the budget mask made to finish within max_tokens: OpenAI's "stop" (complete,
    it parses) with the extension "budget_shaped", streamed alike; a max_tokens below the
    shortest reply is a 400 naming both numbers; free text is cut at max_tokens ("length")."""
    client, gen, _ = served
    shortest = gen.compile(schema=testing.PERSON).completion(0).tokens
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": testing.PERSON}}
    asked = dict(model="tiny", messages=ASK, response_format=fmt, temperature=0)
    reply = client.chat.completions.create(max_tokens=shortest + 1, **asked).choices[0]
    assert reply.finish_reason == "stop" and reply.budget_shaped is True
    jsonschema.validate(json.loads(reply.message.content), testing.PERSON)
    chunks = list(client.chat.completions.create(max_tokens=shortest + 1, stream=True, **asked))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].budget_shaped
    flag = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
    asked_flag = dict(asked, response_format=flag)
    whole = client.chat.completions.create(max_tokens=100, **asked_flag).choices[0]
    assert whole.finish_reason == "stop" and whole.budget_shaped is False
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(max_tokens=shortest - 1, **asked)
    assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "max_tokens_too_small"
    assert f"max_tokens={shortest - 1} is below the {shortest} tokens" in e.value.body["message"]
    free = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3).choices[0]
    assert free.finish_reason == "length" and free.budget_shaped is False


# ---------------------------------------------------------------- tools


def calls_of(reply) -> list | None:
    """A reply's calls, each checked: a stopped "auto" reply is text with no call envelope, or
    calls whose arguments the tool's parameters accept; None for a reply cut at max_tokens."""
    message, finish = reply.message, reply.finish_reason
    if finish == "length":
        assert message.tool_calls is None
        return None
    if finish == "stop":
        assert message.tool_calls is None and OPEN not in message.content
        return []
    assert finish == "tool_calls" and message.tool_calls, reply
    for call in message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    return message.tool_calls


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_replies_are_text_or_calls_with_valid_arguments(served, choice):
    client, *_ = served
    picked = {} if choice is None else {"tool_choice": choice}
    replies = [
        c
        for messages in (ASK_WEATHER, ASK_OTHER)
        for c in client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, n=8, seed=3, temperature=1.0,
            max_tokens=100, **picked,
        ).choices
    ]  # fmt: skip
    made = sum(bool(calls_of(c)) for c in replies)
    text = sum(OPEN not in (c.message.content or OPEN) for c in replies)  # stopped or cut
    assert made >= 4 and text >= 2, f"{made} replies called, {text} answered in text"


def test_auto_calls_stream_in_openai_delta_shape(served):
    client, _, batch_size = served
    temperature = 1.0 if batch_size > 1 else 0.0  # see test_n_choices_each_with_its_own_seed
    settings = dict(model="tiny", messages=ASK_WEATHER, tools=TOOLS, n=4, seed=3, max_tokens=100)
    whole = client.chat.completions.create(temperature=temperature, **settings).choices
    assert any(calls_of(c) for c in whole), "no call to stream"
    content, deltas, finish = {}, {}, {}
    for part in client.chat.completions.create(temperature=temperature, stream=True, **settings):
        for c in part.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            deltas.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole:
        assert finish[c.index] == c.finish_reason
        if c.finish_reason != "tool_calls":  # text, or a call cut at max_tokens: as text
            assert content[c.index] == c.message.content and not deltas[c.index]
            continue
        got = [
            (d.index, d.id, d.type, d.function.name, d.function.arguments) for d in deltas[c.index]
        ]
        sent = [
            (i, t.id, t.type, t.function.name, t.function.arguments)
            for i, t in enumerate(c.message.tool_calls)
        ]
        assert [g[:1] + g[2:] for g in got] == [s[:1] + s[2:] for s in sent]  # ids are fresh
        assert all(g[1].startswith("call_") for g in got)
        assert OPEN not in content[c.index]


def test_tool_choice_none_answers_in_text_and_required_calls(served):
    client, *_ = served
    settings = dict(model="tiny", messages=ASK_WEATHER, tools=TOOLS, n=4, seed=3, max_tokens=100)
    for c in client.chat.completions.create(tool_choice="none", **settings).choices:
        assert c.message.tool_calls is None
    forced = client.chat.completions.create(tool_choice="required", **settings).choices
    assert sum(c.finish_reason == "tool_calls" for c in forced) >= 1
    for c in forced:
        if c.finish_reason == "tool_calls":
            calls_of(c)


def test_parallel_tool_calls_false_allows_one_call(served):
    _, gen, _ = served
    one = '<tool_call>[{"function":"get_weather","arguments":{"city":"Paris"}}]</tool_call>'
    two = one.replace("}}]", '}},{"function":"get_weather","arguments":{"city":"Rome"}}]')
    for parallel, accepted in ((None, (True, True)), (False, (True, False))):
        request = ChatRequest(messages=ASK_WEATHER, tools=TOOLS, parallel_tool_calls=parallel)
        constraint = gen.compile(**plan(request, CONFIG).constraint)
        assert (constraint.accepts(one), constraint.accepts(two)) == accepted
        assert constraint.accepts("plain text") and not constraint.accepts(f"hi {OPEN} bad")


def test_a_tool_whose_parameters_cannot_compile_is_a_400_naming_it(served):
    client, *_ = served
    bad = {"type": "object", "properties": {"link": {"type": "string", "format": "uri-template"}}}
    tools = TOOLS + [{"type": "function", "function": {"name": "open_link", "parameters": bad}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK_WEATHER, tools=tools)
    body = e.value.body
    assert body["param"] == "tools" and body["code"] == "unsupported_schema"
    assert "open_link" in body["message"] and "uri-template" in body["message"]


def test_an_agent_loop_call_then_result_then_answer(served):
    """The call goes back to the model in the envelope it writes, the tool's result through
    the chat template, and the next reply comes."""
    client, gen, _ = served
    settings = dict(model="tiny", tools=TOOLS, seed=3, temperature=0.0, max_tokens=100)
    first = client.chat.completions.create(messages=ASK_WEATHER, **settings).choices[0]
    (call,) = calls_of(first)
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}
    history = ASK_WEATHER + [first.message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(messages=history, tool_choice="none", **settings)
    assert final.choices[0].message.content is not None
    shown = gen.tokenizer.decode(
        gen.encode_prompt(plan(ChatRequest(messages=history), CONFIG).messages)
    )
    assert f'{OPEN}[{{"function": "get_weather", "arguments": {call.function.arguments}}}]' in shown
    assert shown.endswith('{"celsius": 18}')
