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


ALICE = {"name": "Alice", "age": 30}  # what every block's prompt states


def test_the_openai_sdk_block(url):
    """Each block's values, not only their validity: the default model gets them right."""
    ns = run_block("openai", url)
    assert len(ns["reply"].choices) == 2
    for choice in ns["reply"].choices:
        jsonschema.validate(json.loads(choice.message.content), ns["person"])
        assert json.loads(choice.message.content) == ALICE
        assert choice.logprobs.content, "no log-probs came back"
    answer = ns["answer"].choices[0]
    (call,) = answer.message.tool_calls
    assert answer.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    notes = ns["notes"].choices[0]
    assert notes.finish_reason in ("stop", "length") and "\n\n" not in notes.message.content
    assert "Paris" in notes.message.content or "Eiffel" in notes.message.content


def test_the_instructor_block(url):
    ns = run_block("instructor", url)
    assert isinstance(ns["person"], ns["Person"]) and ns["mode"] == ns["instructor"].Mode.TOOLS
    assert ns["person"].model_dump() == ALICE  # the TOOLS mode's; the loop printed both


def test_the_langchain_block(url):
    ns = run_block("langchain_openai", url)
    assert isinstance(ns["person"], ns["Person"]) and ns["person"].model_dump() == ALICE
    (call,) = ns["call"].tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}


def test_the_pydantic_ai_block(url):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed (its extra)")
    ns = run_block("pydantic", url)
    assert isinstance(ns["result"].output, ns["Person"])
    assert ns["result"].output.model_dump() == ALICE
    parts = [p for m in ns["result"].all_messages() for p in m.parts]
    returned = [p for p in parts if isinstance(p, ns["ToolReturnPart"])]
    assert any(p.tool_name == "lookup_age" for p in returned), "the tool loop did not run"
    calls = [p for p in parts if type(p).__name__ == "ToolCallPart" and p.tool_name == "lookup_age"]
    assert calls and all(p.args_as_dict() == {"name": "Alice"} for p in calls)


def test_the_readme_server_block(url):
    """The README's `openai` example gives the value its comment promises."""
    readme = (DOC.parents[1] / "README.md").read_text().split("\n## Server\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert DOC_URL in code
    namespace: dict = {}
    exec(compile(code.replace(DOC_URL, url), "README.md (server)", "exec"), namespace)
    promised = re.search(r"message\.content == '(.*)'", code).group(1)
    assert namespace["r"].choices[0].message.content == promised == '{"name":"Alice"}'
