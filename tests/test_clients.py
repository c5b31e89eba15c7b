"""The server's OpenAI fields (stop, logprobs, n, seed) through the real ``openai`` client, on a
real HTTP server in this process (uvicorn in a thread) over a tiny model: quick enough to check
each field against the Python API token for token. Both ways of running requests: one at a
time, and batched."""

import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai", reason="the client tests need the [test] extra (openai)")
uvicorn = pytest.importorskip("uvicorn", reason="the client tests need the [serve] extra")

from constrained_spec import Generator, testing  # noqa: E402
from constrained_spec.decoding.drafters import CompositeDrafter  # noqa: E402
from constrained_spec.server import ServerConfig, create_app  # noqa: E402

FREE = "[a-z ]{0,40}"
ASK = [{"role": "user", "content": "hello"}]


def tiny_generator() -> Generator:
    tokenizer = testing.tiny_tokenizer(
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    return Generator(testing.tiny_model(tokenizer, seed=0), tokenizer, draft=CompositeDrafter())


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def served(request):
    """(client, the server's Generator, its batch size) for a server on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(model="tiny", batch_size=request.param, max_tokens=64, max_queue=8)
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
