"""The clients people already use, against a real server process on the default model: each
Python block of docs/server.md's "Clients" section runs as written (only the port differs), and
what it produced is checked. A block whose library is not installed is skipped (each is an
optional extra: pip install -e ".[instructor]", ".[langchain]", ".[pydantic-ai]")."""

import json
import re
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("fastapi", reason="the server tests need the [serve] extra (fastapi)")

from constrained_spec.testing import server_process  # noqa: E402

pytestmark = pytest.mark.real_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "server.md"
DOC_URL = "http://127.0.0.1:8000/v1"


def blocks() -> dict[str, str]:
    """{the client library a block imports first: the block} of the Clients section."""
    section = DOC.read_text().split("\n## Clients\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"```python\n(.*?)```", section, re.S)
    return {re.search(r"^(?:from|import) (\w+)", b, re.M).group(1): b for b in found}


@pytest.fixture(scope="module")
def url():
    args = ["--api-key", "sk-local", "--threads", "1", "--batch-size", "4", "--max-tokens", "256"]
    with server_process(*args) as base:
        yield base + "/v1"


def run_block(library: str, url: str) -> dict:
    pytest.importorskip(library, reason=f"{library} is not installed (its extra)")
    code = blocks()[library]
    assert DOC_URL in code, "the block no longer names the documented address"
    namespace: dict = {}
    exec(compile(code.replace(DOC_URL, url), f"docs/server.md ({library})", "exec"), namespace)
    return namespace


def test_the_doc_shows_each_client():
    assert set(blocks()) == {"openai", "instructor", "langchain_openai", "pydantic"}


def test_the_openai_sdk_block(url):
    ns = run_block("openai", url)
    assert len(ns["reply"].choices) == 2
    for choice in ns["reply"].choices:
        jsonschema.validate(json.loads(choice.message.content), ns["person"])
        assert choice.logprobs.content, "no log-probs came back"
    answer = ns["answer"].choices[0]
    if answer.finish_reason == "tool_calls":
        for call in answer.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), ns["weather"])
    else:
        assert answer.finish_reason in ("stop", "length") and "\n\n" not in answer.message.content


def test_the_instructor_block(url):
    ns = run_block("instructor", url)
    assert isinstance(ns["person"], ns["Person"]) and ns["mode"] == ns["instructor"].Mode.TOOLS


def test_the_langchain_block(url):
    ns = run_block("langchain_openai", url)
    assert isinstance(ns["person"], ns["Person"])
    (call,) = ns["call"].tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_the_pydantic_ai_block(url):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed (its extra)")
    ns = run_block("pydantic", url)
    assert isinstance(ns["result"].output, ns["Person"])
    parts = [p for m in ns["result"].all_messages() for p in m.parts]
    returned = [p for p in parts if isinstance(p, ns["ToolReturnPart"])]
    assert any(p.tool_name == "lookup_age" for p in returned), "the tool loop did not run"
