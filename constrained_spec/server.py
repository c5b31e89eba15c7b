"""An OpenAI-compatible HTTP server: ``constrained-spec serve`` (``pip install -e ".[serve]"``).

POST /v1/chat/completions turns ``response_format`` (json_schema / json_object), ``tools`` (text
or calls for ``tool_choice`` "auto", a call when it is forced), or the extension fields ``regex`` / ``grammar`` into a constraint, checks
everything it can before queueing (the schema is compiled here, in milliseconds: a bad schema is a 400 at
once), and hands the request to the one worker thread that owns the Generator.

With ``batch_size`` 1 requests run one at a time through ``Generator.stream``; with more, up to
that many decode together through the one decode loop (decoding/loop.py: one target forward per round
for all of them), a queued request joining as soon as a slot is free (``Worker.take``).
A job's events (start, text pieces, done or error) go back to its HTTP handler through an asyncio
queue; a handler whose client has gone cancels its job, which frees its queue slot at once and
stops decoding at the next round (closing Generator.stream stops the decode loop).
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import dataclasses
import hmac
import json
import queue
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from .constraints import grammar_for, grammar_names, load_grammar, load_schema
from .decoding import cost, loop
from .decoding.text import MAX_STOP_STRINGS, held_prefix, stop_problem
from .errors import BudgetTooSmall, ConstraintError, GenerationInputError
from .generator import MAX_TOP_LOGPROBS, Generator
from .generator import Request as GenerationRequest
from .model import DEFAULT_MODEL

__all__ = ["ServerConfig", "create_app", "serve"]

FREE_TEXT = r"[\s\S]*"  # no constraint asked for: any text, ended by the model's EOS
# The envelope of the calls in an "auto" reply, in text (SmolLM2's chat template has no tools of
# its own): free text until OPEN, then a JSON list of {CALLED: ..., "arguments": {...}}, each
# exact to its tool's parameters, then CLOSE. The function's key is not "name": beside an
# argument or a later answer's field called "name" (the most common one), the 135M model copied
# the function's name into it (lookup_age(name="lookup_age"), then Person(name="lookup_age"))
# where with "function" it wrote "Alice" (docs/server.md's pydantic-ai agent).
OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALLED = "function"
AUTO = "<auto>"  # Plan.tool of an "auto" reply; never a function's name (those are [\w.-])
POLL_S = 0.25  # how often a waiting handler checks whether its client has gone
# glibc keeps the heap pages that requests' short-lived buffers freed (masks, matchers, logits):
# in benchmarks/serve.py soak the free heap grew by 87 MB over 1,500 requests with the caches flat, and
# malloc_trim gave it back. The worker trims at most this often, between rounds (~20 ms).
TRIM_EVERY_S = 10.0


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    draft: str = "auto"  # generator.DRAFTS
    weights: str = "auto"  # target.WEIGHTS
    open_objects: bool = False  # Generator's: undeclared properties allowed where unspecified
    api_key: str | None = None  # None: no key needed
    max_body_bytes: int = 1 << 20  # 413 above this
    max_schema_bytes: int = 64 << 10  # a schema (or regex) longer than this as JSON text: 400
    max_tokens: int = 4096  # the most a request may ask for: 400 above it
    default_max_tokens: int = 512  # when a request names none
    max_queue: int = 64  # requests waiting or running; 429 above it
    threads: int | None = None  # torch's intra-op threads (None: torch's default, the cores)
    # requests decoded together (decoding/loop.py); 1: one at a time via stream(), with any drafter.
    # 16 clients got 1.55x one client's throughput at 16, 1.04x at 1 (docs/server.md).
    batch_size: int = 16


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> JSONResponse:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(self.status)
        kind = kind or ("server_error" if self.status >= 500 else "invalid_request_error")
        body = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


# ---------------------------------------------------------------- the request, checked


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # fields a client sends and we do not use

    messages: list[dict[str, Any]]
    model: str | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stream: bool = False
    n: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    regex: str | None = None  # extension: the whole reply matches this regex
    grammar: str | None = None  # extension: the name of a shipped grammar (grammars/)
    # extension: the reply finishes within max_tokens (default where there is a constraint)
    budget_mask: bool | None = None
    loop_guard: bool | None = None  # extension: Request.loop_guard (off by default)


@dataclass(frozen=True)
class Plan:
    """What the worker runs for one request: everything checked, nothing needing the model."""

    messages: list[dict]
    constraint: dict  # {"schema": dict}, {"regex": str} or {"grammar": str} (Generator.compile's)
    tool: str | None  # "" when the reply names one of several tools; AUTO; None: a plain reply
    temperature: float
    top_p: float | None
    max_tokens: int
    seed: int | None
    stream: bool
    stop: list[str] | None = None  # the reply ends before the first (where it may end)
    top_logprobs: int | None = None  # None: no log-probs; k: each token's and k alternatives
    n: int = 1  # choices: rows of the batch, each with its own seed
    budget_mask: bool = True  # Request.budget_mask: the reply finishes within max_tokens
    loop_guard: bool = False  # Request.loop_guard: no immediate repeat of a stretch of the reply


def plan(req: ChatRequest, config: ServerConfig) -> Plan:
    """Check a request and turn it into a Plan; APIError(400) naming the field otherwise."""
    _refuse_unsupported(req)
    _check_stop(req)
    asked = [n for n in (req.max_completion_tokens, req.max_tokens) if n is not None]
    max_tokens = asked[0] if asked else min(config.default_max_tokens, config.max_tokens)
    if not 1 <= max_tokens <= config.max_tokens:
        raise APIError(
            400,
            f"max_tokens={max_tokens} is outside 1..{config.max_tokens}, this server's limit: "
            "ask for fewer tokens (or start the server with a higher --max-tokens).",
            "max_tokens_too_large" if max_tokens > config.max_tokens else "invalid_max_tokens",
            "max_tokens",
        )
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    if not 0 <= temperature <= 2:
        raise APIError(
            400, f"temperature={temperature} must be in [0, 2].", "invalid_value", "temperature"
        )
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p={req.top_p} must be in (0, 1].", "invalid_value", "top_p")
    messages = _messages(req.messages)
    constraint, tool, preamble = _constraint(req, config)
    if preamble:  # tools: the model reads their descriptions in a system message first
        messages = [{"role": "system", "content": preamble}] + messages
    top_p = None if req.top_p in (None, 1) else req.top_p
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    # free text has no form to keep: cut at max_tokens ("length"), as OpenAI's
    budget_mask = constraint != {"regex": FREE_TEXT} if req.budget_mask is None else req.budget_mask
    return Plan(
        messages, constraint, tool, temperature, top_p, max_tokens, req.seed, req.stream,
        stop, _top_logprobs(req), _choices(req, config), budget_mask, bool(req.loop_guard),
    )  # fmt: skip


def _choices(req: ChatRequest, config: ServerConfig) -> int:
    n = 1 if req.n is None else req.n
    if not 1 <= n <= config.max_queue:
        raise APIError(
            400,
            f"n={n} must be in 1..{config.max_queue} (this server's --max-queue: each choice "
            "is a request in its queue).",
            "invalid_value",
            "n",
        )
    return n


def _check_stop(req: ChatRequest) -> None:
    problem = stop_problem(req.stop)
    if problem is not None:
        many = isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS
        code = "array_above_max_length" if many else "invalid_value"
        raise APIError(400, f"stop {problem}.", code, "stop")


def _top_logprobs(req: ChatRequest) -> int | None:
    """None without logprobs, else how many alternatives each token's entry lists."""
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true.", "invalid_value", "top_logprobs")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(
            400, f"top_logprobs={top} must be in 0..{MAX_TOP_LOGPROBS}.", "invalid_value",
            "top_logprobs",
        )  # fmt: skip
    return top if req.logprobs else None


def _refuse_unsupported(req: ChatRequest) -> None:
    extra = req.model_extra or {}  # fields not modelled above; these would change the reply
    for name, ok, why in (
        ("frequency_penalty", not extra.get("frequency_penalty"), "penalties are not applied"),
        ("presence_penalty", not extra.get("presence_penalty"), "penalties are not applied"),
        ("logit_bias", not extra.get("logit_bias"), "logits are not biased"),
    ):
        if not ok:
            raise APIError(400, f"{name} is not supported: {why}; remove it.", "unsupported", name)


def _messages(messages: list[dict]) -> list[dict]:
    """Chat messages as the chat template takes them: role and text content."""
    if not messages:
        raise APIError(400, "messages is empty: send at least one message.", "invalid", "messages")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"messages[{i}].role={role!r} is unknown.", "invalid", "messages")
        if isinstance(content, list):  # content parts: only text is understood
            if any(p.get("type") != "text" for p in content):
                raise APIError(
                    400,
                    f"messages[{i}] has a non-text content part: this model reads text only.",
                    "unsupported",
                    "messages",
                )
            content = "".join(p.get("text", "") for p in content)
        if m.get("tool_calls"):  # earlier calls, shown to the model in the envelope
            content = (content or "") + _enveloped(m["tool_calls"])
        out.append({"role": "system" if role == "developer" else role, "content": content or ""})
    return out


def _enveloped(calls: list[dict]) -> str:
    """Earlier calls as the model writes them: OPEN, a JSON list of {name, arguments}, CLOSE."""
    listed = []
    for call in calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:  # shown as the client sent it
            arguments = function.get("arguments")
        listed.append({CALLED: function.get("name"), "arguments": arguments})
    return f"{OPEN}{json.dumps(listed)}{CLOSE}"


def _constraint(req: ChatRequest, config: ServerConfig) -> tuple[dict, str | None, str]:
    """(constraint, tool, preamble) from whichever of response_format / tools / regex /
    grammar; the constraint is {"regex": ...} or {"grammar": ...} (Generator.compile's)."""
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    given = [
        name
        for name, v in (
            ("response_format", (req.response_format or {}).get("type", "text") != "text"),
            ("tools", tools),
            ("regex", req.regex),
            ("grammar", req.grammar),
        )
        if v
    ]
    if len(given) > 1:
        raise APIError(400, f"pass only one of {' and '.join(given)}.", "invalid", given[1])
    if tools:
        functions = _functions(tools, config)
        if req.tool_choice in (None, "auto"):
            return _auto_constraint(functions, req.parallel_tool_calls is not False, config)
        return _tool_constraint(functions, req.tool_choice, config)
    if req.regex is not None:
        return _regex_constraint(req.regex, config), None, ""
    if req.grammar is not None:
        return _grammar_constraint(req.grammar, config), None, ""
    return _response_format_constraint(req.response_format or {"type": "text"}, config), None, ""


def _regex_constraint(regex: str, config: ServerConfig) -> dict:
    _check_size(regex, config, "regex")
    try:
        grammar_for(regex=regex)  # refused before queueing
    except ConstraintError as e:
        raise APIError(400, str(e), "invalid_regex", "regex") from None
    return {"regex": regex}


def _grammar_constraint(name: str, config: ServerConfig) -> dict:
    if name not in grammar_names():  # names only: never a path on this machine
        raise APIError(
            400,
            f"unknown grammar {name!r}: this server has {', '.join(grammar_names())}.",
            "unknown_grammar",
            "grammar",
        )
    loaded = load_grammar(name)
    if "schema" in loaded:
        return _schema_constraint(loaded["schema"], config, "grammar")
    return loaded


def _response_format_constraint(fmt: dict, config: ServerConfig) -> dict:
    """json_object, json_schema, or free text."""
    if fmt.get("type") == "json_object":
        return _schema_constraint({"type": "object"}, config, "response_format")
    if fmt.get("type") == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema is missing: send "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.',
                "invalid_schema",
                "response_format",
            )
        return _schema_constraint(schema, config, "response_format")
    if fmt.get("type") != "text":
        raise APIError(
            400,
            f"response_format type {fmt.get('type')!r} is unknown: use json_schema, "
            "json_object or text.",
            "invalid",
            "response_format",
        )
    return {"regex": FREE_TEXT}


def _functions(tools: list[dict], config: ServerConfig) -> dict[str, dict]:
    """{name: function} of the tools, each one's parameters checked on its own: a schema that
    cannot be compiled is a 400 naming the tool (and the keyword)."""
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]{1,64}", name):
            raise APIError(
                400, f"tools[{i}].function.name={name!r} must be 1-64 letters, digits, _, . or -.",
                "invalid", "tools",
            )  # fmt: skip
        try:
            _schema_constraint(function.get("parameters") or {"type": "object"}, config, "tools")
        except APIError as e:
            e.message = f"tool {name!r} (tools[{i}]): {e.message}"
            raise APIError(e.status, e.message, e.code, e.param) from None
        functions[name] = function
    return functions


def _auto_constraint(functions: dict, parallel: bool, config: ServerConfig) -> tuple:
    """An "auto" reply: free text, or text and then calls to the tools in the envelope (one at
    most unless ``parallel``) that end it, each call's arguments exact to its tool's
    parameters: an llguidance grammar that is free text until OPEN (text never holds OPEN
    otherwise)."""
    envelopes = [_envelope(n, _parameters(f)) for n, f in functions.items()]
    calls = {"type": "array", "items": {"anyOf": envelopes}, "minItems": 1}
    calls |= {} if parallel else {"maxItems": 1}
    _check_size(calls, config, "tools")
    grammar = "\n".join([
        "start: TEXT | call",  # calls end the reply (finish_reason "tool_calls")
        f"call: head calls {json.dumps(CLOSE)}",
        f"head[lazy]: TEXT {json.dumps(OPEN)}",
        f"calls: {_json_rule(calls, config)}",
        f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(OPEN)}(?s:.*)/",
    ])  # fmt: skip
    listing = json.dumps([{"type": "function", "function": f} for f in functions.values()])
    preamble = (
        f"You may call these functions:\n<tools>{listing}</tools>\nTo call them, write "
        f'{OPEN}[{{"{CALLED}": ..., "arguments": {{...}}}}]{CLOSE}; otherwise answer in text.'
    )
    return {"grammar": grammar}, AUTO, preamble


def _json_rule(schema: dict, config: ServerConfig) -> str:
    """The ``%json {...}`` rule that compiles ``schema`` as a schema constraint does (rewritten
    to be sound), for a Lark grammar of our own."""
    grammar = grammar_for(open_objects=config.open_objects, schema=load_schema(schema))
    head, tail = "start: %json ", grammar[grammar.index("\n%llguidance") :]
    assert grammar.startswith(head), "the engine's schema grammar changed its form"
    return grammar[len("start: ") : len(grammar) - len(tail)]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def _tool_constraint(functions: dict, choice, config: ServerConfig) -> tuple[dict, str, str]:
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise APIError(
                400,
                f"tool_choice names {name!r}, which is not in tools ({', '.join(map(str, functions))}).",
                "invalid",
                "tool_choice",
            )
        functions = {name: functions[name]}
    elif choice != "required":
        raise APIError(
            400,
            f'tool_choice={choice!r} is unknown: pass "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}.',
            "unsupported_tool_choice",
            "tool_choice",
        )
    params = {n: _parameters(f) for n, f in functions.items()}
    if len(params) == 1:  # the reply is the arguments object itself
        ((name, schema),) = params.items()
        preamble = f"Call the function {name}; reply with its arguments as one JSON object."
    else:  # the reply names the function too: {CALLED: ..., "arguments": {...}}
        name, schema = "", {"anyOf": [_envelope(n, s) for n, s in params.items()]}
        preamble = f'Call one function; reply as {{"{CALLED}": ..., "arguments": {{...}}}}.'
    listing = json.dumps(list(functions.values()))
    constraint = _schema_constraint(schema, config, "tools")
    return constraint, name, f"Functions: {listing}\n{preamble}"


def _envelope(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {CALLED: {"const": name}, "arguments": parameters},
        "required": [CALLED, "arguments"],
        "additionalProperties": False,
    }


def _schema_constraint(schema: dict, config: ServerConfig, param: str) -> dict:
    """{"schema": ...} once llguidance would compile it (in milliseconds, as Generator.compile
    does)."""
    _check_size(schema, config, param)
    try:
        schema = load_schema(schema)
        grammar_for(open_objects=config.open_objects, schema=schema)
    except ConstraintError as e:  # UnsupportedSchemaError names the keyword and its place
        code = "unsupported_schema" if hasattr(e, "keyword") else "invalid_schema"
        raise APIError(400, str(e), code, param) from None
    return {"schema": schema}


def _check_size(value, config: ServerConfig, param: str) -> None:
    size = len(value if isinstance(value, str) else json.dumps(value))
    if size > config.max_schema_bytes:
        raise APIError(
            400,
            f"the {param} constraint is {size} bytes, above this server's limit of "
            f"{config.max_schema_bytes}: simplify it (or start the server with a higher "
            "--max-schema-bytes).",
            "schema_too_large",
            param,
        )


# ---------------------------------------------------------------- the worker


@dataclass
class Job:
    """One choice of a request: its plan (its own seed) and where its events go, (index, kind,
    value) on the queue its request's jobs share."""

    plan: Plan
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the choice it decodes
    cancelled: threading.Event = field(default_factory=threading.Event)
    released: bool = False  # its queue slot was given back

    def send(self, kind: str, value=None) -> None:  # from the worker thread
        try:
            event = (self.index, kind, value)
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass


class Worker:
    """The one thread that loads and owns the Generator and runs the queued jobs."""

    def __init__(self, config: ServerConfig, load: Callable[[], Any]):
        self.config, self.load = config, load
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.lock = threading.Lock()
        self.pending = 0  # jobs admitted and not yet released (waiting or running)
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.gen, self.load_error = None, None
        self.loaded = threading.Event()
        self.trimmed = time.monotonic()  # when the heap was last trimmed (TRIM_EVERY_S)
        threading.Thread(target=self._main, name="constrained-spec-worker", daemon=True).start()

    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs, all of them or (429) none."""
        with self.lock:
            if self.pending + len(jobs) > self.config.max_queue:
                raise APIError(
                    429,
                    f"the queue is full ({self.config.max_queue} requests waiting or running): "
                    "retry shortly.",
                    "queue_full",
                )
            self.pending += len(jobs)
        for job in jobs:
            self.jobs.put(job)

    def release(self, job: Job, outcome: str) -> None:
        """Give back the job's slot (once) and count how it ended."""
        with self.lock:
            if not job.released:
                job.released, self.pending = True, self.pending - 1
                self.counts[outcome] += 1

    def cancel(self, job: Job) -> None:
        job.cancelled.set()  # the worker stops at its next round (or skips the job)
        self.release(job, "cancelled")

    def take(self, n: int, wait: bool) -> list[Job]:
        """Up to ``n`` queued jobs whose clients are still there; waits for one if ``wait``."""
        if time.monotonic() - self.trimmed > TRIM_EVERY_S:
            self.trimmed = time.monotonic()
            _malloc_trim()
        jobs: list[Job] = []
        while len(jobs) < n:
            try:
                job = self.jobs.get(block=wait and not jobs)
            except queue.Empty:
                break
            if not job.cancelled.is_set():
                jobs.append(job)
        return jobs

    def _main(self) -> None:
        try:
            self.gen = self.load()
            cost.pass_cost(self.gen.target, self.config.batch_size)  # before the first request
        except Exception as e:  # reported by /health and every request, not a dead thread
            self.load_error = f"{type(e).__name__}: {e}"
        self.loaded.set()
        if self.gen is not None and self.config.batch_size > 1:
            self._run_batched()
        while True:  # one at a time (or every request's error, if the model failed to load)
            for job in self.take(1, wait=True):
                self._run(job)

    def _run(self, job: Job) -> None:
        p = job.plan
        try:
            if self.gen is None:
                raise APIError(500, f"the model failed to load: {self.load_error}", "load_failed")
            stream = self.gen.stream(as_request(p))  # checks and compiles, before model work
            job.send("start", len(self.gen.encode_prompt(p.messages)))
            for item in stream:
                if job.cancelled.is_set():  # the client has gone: stop decoding now
                    stream.close()
                    return
                if isinstance(item, str):
                    job.send("piece", item)
                else:
                    self._end(job, "completed", "done", item)
        except (ConstraintError, GenerationInputError) as e:  # the schema compile, the prompt
            self._end(job, "failed", "error", _input_error(e))
        except APIError as e:
            self._end(job, "failed", "error", e)
        except Exception as e:  # a bug: answer 500 with its name, keep serving
            error = APIError(500, f"{type(e).__name__}: {e}", "internal_error")
            self._end(job, "failed", "error", error)
        finally:  # a cancelled job's slot went back when it was cancelled
            self.release(job, "failed")

    def _end(self, job: Job, outcome: str, kind: str, value) -> None:
        """A job's last event, its slot given back first: a client that sends its next
        request as soon as it hears finds the slot free."""
        self.release(job, outcome)
        job.send(kind, value)

    def _run_batched(self) -> None:
        """Decode up to batch_size jobs together (loop.step: one target forward per round for
        all of them, the exact rule per row); a job joins as soon as a slot is free, and a job
        whose client left is dropped before the next round."""
        active: list[_Live] = []
        while True:
            for job in self.take(self.config.batch_size - len(active), wait=not active):
                if (live := self._admit(job)) is not None:
                    active.append(live)
            active = [a for a in active if not a.job.cancelled.is_set()]
            if not active:
                continue
            try:
                loop.step(self.gen.target, [a.row for a in active])
            except Exception as e:  # a bug: every job in the round answers 500
                for a in active:
                    error = APIError(500, f"{type(e).__name__}: {e}", "internal_error")
                    self._end(a.job, "failed", "error", error)
                active = []
            for a in list(active):
                if piece := a.new_text():
                    a.job.send("piece", piece)
                if a.row.finished:
                    a.row.stats.total_s = time.perf_counter() - a.row.started
                    self._end(a.job, "completed", "done", self.gen.result(a.row))
                    active.remove(a)

    def _admit(self, job: Job) -> _Live | None:
        """The job as a batch row, checked, compiled and prefilled; None (and its error sent)
        if its request is unusable."""
        try:
            row = self.gen.row(as_request(job.plan), batched=True)
            loop.admit(self.gen.target, row)
        except (ConstraintError, GenerationInputError) as e:
            self._end(job, "failed", "error", _input_error(e))
            return None
        except Exception as e:  # a bug: answer 500 with its name, keep serving the others
            error = APIError(500, f"{type(e).__name__}: {e}", "internal_error")
            self._end(job, "failed", "error", error)
            return None
        job.send("start", len(row.prompt))
        return _Live(job, row)


def _malloc_trim() -> None:
    """Give glibc's free heap pages back to the system (nothing where there is no glibc)."""
    if _libc_trim is not None:
        _libc_trim(0)


try:
    _libc_trim = ctypes.CDLL(None).malloc_trim  # glibc only (not musl, macOS, Windows)
except (OSError, AttributeError, TypeError):
    _libc_trim = None


def _input_error(e: ValueError) -> APIError:
    """A request the Generator refused (before any model work) as a 400."""
    if isinstance(e, BudgetTooSmall):
        return APIError(
            400,
            f"max_tokens={e.given} is below the {e.shortest} tokens of the shortest reply found "
            f"for this request's format ({e.text!r}, then the end): raise max_tokens to "
            f'{e.shortest} at least, or send "budget_mask": false to have the reply cut.',
            "max_tokens_too_small",
            "max_tokens",
        )
    return APIError(400, str(e), "invalid_request")


def as_request(p: Plan) -> GenerationRequest:
    """A job's plan as the Generator's request."""
    return GenerationRequest(
        p.messages,
        **p.constraint,
        max_new_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        seed=p.seed,
        stop=p.stop,
        logprobs=p.top_logprobs is not None,
        top_logprobs=p.top_logprobs or 0,
        budget_mask=p.budget_mask,
        loop_guard=p.loop_guard,
    )


@dataclass
class _Live:
    """A job decoding as a batch row, and its text's decoder (a split character waits)."""

    job: Job
    row: Any  # loop.Row
    utf8: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def new_text(self) -> str:
        """The reply's text committed since the last call, as far as it may be shown."""
        finished = self.row.finished
        return self.utf8.decode(self.row.reply.unsent(finished), final=finished)


# ---------------------------------------------------------------- responses


def usage(prompt_tokens: int, results: list) -> dict:
    """The request's usage, its choices' tokens together (the prompt counted once)."""
    total = lambda f: sum(f(r) for r in results)
    completion = total(lambda r: len(r.token_ids))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        # OpenAI's field: prompt tokens whose keys and values came from an earlier prompt
        "prompt_tokens_details": {"cached_tokens": results[0].stats.cached_prompt_tokens},
        "speculation": {  # extension: how the replies were decoded
            "target_calls": total(lambda r: r.stats.target_calls),
            "drafted_tokens": total(lambda r: r.stats.drafted),
            "accepted_drafts": total(lambda r: r.stats.accepted),
        },
    }


# Result.finish_reason in OpenAI's terms: "budget" (ended by EOS after the budget mask removed a
# token the model drew: complete and valid, made to finish within max_tokens) is "stop", since
# OpenAI's "length" means a cut reply (openai's parse() raises on it); the choice's extension
# field "budget_shaped" says which it was.
OPENAI_FINISH = {"budget": "stop"}


def message(plan_: Plan, result) -> tuple[dict, str]:
    """The reply message and finish_reason; a stopped tool reply is a tool call, an "auto" one
    its text and calls (if it made any)."""
    finish = OPENAI_FINISH.get(result.finish_reason, result.finish_reason)
    if plan_.tool is None or finish != "stop":
        return {"role": "assistant", "content": result.text}, finish
    if plan_.tool == AUTO:
        content, calls = split_calls(result.text)
        if not calls:
            return {"role": "assistant", "content": result.text}, "stop"
        return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"
    name, arguments = plan_.tool, result.text
    if not name:  # several tools: the reply is {CALLED: ..., "arguments": {...}}
        envelope = json.loads(result.text)
        name, arguments = envelope[CALLED], json.dumps(envelope["arguments"])
    return {"role": "assistant", "content": None, "tool_calls": [_call(name, arguments)]}, (
        "tool_calls"
    )


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def split_calls(text: str) -> tuple[str, list[dict]]:
    """An "auto" reply's text outside its calls (stripped) and its calls: OPEN, one JSON list
    (parsed, not searched for CLOSE: an argument may hold CLOSE), CLOSE."""
    start = text.find(OPEN)
    if start == -1:
        return text.strip(), []
    listed, end = json.JSONDecoder().raw_decode(text, start + len(OPEN))
    assert text.startswith(CLOSE, end), "the grammar closes the calls"
    calls = [_call(c[CALLED], json.dumps(c["arguments"])) for c in listed]
    return (text[:start] + text[end + len(CLOSE) :]).strip(), calls


def logprobs(result, vocab) -> dict | None:
    """choices[i].logprobs in OpenAI's shape: each token's text, bytes and log-prob under the
    masked distribution it was drawn from, and the most likely tokens there."""
    if result.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        data = vocab.output_bytes([token])
        return {
            "token": data.decode("utf-8", errors="replace"),
            "logprob": logprob,
            "bytes": list(data),
        }

    content = [
        {**entry(s.token, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
        for s in result.logprobs
    ]
    return {"content": content, "refusal": None}


def chunk(rid: str, model: str, index: int, delta: dict, finish: str | None = None, **extra) -> str:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    for key in ("logprobs", "budget_shaped"):  # the choice's, not the chunk's
        if key in extra:
            choice[key] = extra.pop(key)
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


# ---------------------------------------------------------------- the app


def create_app(config: ServerConfig, load: Callable[[], Any] | None = None) -> FastAPI:
    """The FastAPI app; ``load`` builds the Generator in the worker thread (default: the
    configured model via Generator.from_pretrained)."""
    app = FastAPI(title="constrained_spec", docs_url=None, redoc_url=None)
    worker = Worker(config, load or (lambda: _load(config)))
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.get("/health")
    async def health():
        status = "error" if worker.load_error else "ok" if worker.loaded.is_set() else "loading"
        code = {"ok": 200, "loading": 503, "error": 500}[status]
        body = {"status": status, "queue": worker.pending, **worker.counts}
        if worker.gen is not None:  # whether prompts are kept for reuse (llama.PromptCache)
            body["prompt_cache"] = getattr(worker.gen.target, "prompt_cache", None) is not None
        if worker.load_error:
            body["error"] = worker.load_error
        return JSONResponse(body, status_code=code)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, config)
        model = {"id": config.model, "object": "model", "created": 0, "owned_by": "local"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _authorize(request, config)
        # translating a schema may take a while (bounded): off the event loop
        p = await asyncio.to_thread(plan, await _read_request(request, config), config)
        if not worker.loaded.is_set():
            raise APIError(503, "the model is still loading: retry in a few seconds.", "loading")
        jobs = _jobs(p, asyncio.get_running_loop())
        worker.submit(jobs)
        _, kind, value = await _next_event(jobs, request, worker)
        if kind == "error":  # every choice would fail alike: the request is refused
            _cancel(jobs, worker)
            raise value
        reply = _Reply(jobs, worker, f"chatcmpl-{uuid.uuid4().hex}", config.model, value)
        if p.stream:
            events = _sse(reply, request)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _complete(reply, request)

    return app


def _load(config: ServerConfig):
    if config.threads is not None:  # on a shared CPU one thread can be many times faster
        torch.set_num_threads(config.threads)
    return Generator.from_pretrained(
        config.model,
        draft=config.draft,
        weights=config.weights,
        open_objects=config.open_objects,
    )


def _authorize(request: Request, config: ServerConfig) -> None:
    if config.api_key is None:
        return
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), config.api_key.encode()):
        raise APIError(
            401, "wrong or missing API key: send 'Authorization: Bearer KEY'.", "invalid_api_key"
        )


async def _read_request(request: Request, config: ServerConfig) -> ChatRequest:
    declared = request.headers.get("content-length")
    too_large = APIError(
        413,
        f"the request body is larger than this server's limit of {config.max_body_bytes} "
        "bytes: send less (or start the server with a higher --max-body-bytes).",
        "request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise too_large  # before reading it
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > config.max_body_bytes:
            raise too_large
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise APIError(
            422,
            f"{where}: {first['msg']} ({len(e.errors())} problem(s) in the body).",
            "invalid_request_body",
            where,
        ) from None


def _jobs(p: Plan, loop: asyncio.AbstractEventLoop) -> list[Job]:
    """A request's n jobs, one per choice, sharing one event queue; choice i samples with
    seed + i (a fresh seed each where none is given)."""
    events: asyncio.Queue = asyncio.Queue()
    seeded = lambda i: dataclasses.replace(p, seed=None if p.seed is None else p.seed + i)
    return [Job(seeded(i), loop, events, i) for i in range(p.n)]


def _cancel(jobs: list[Job], worker: Worker) -> None:
    for job in jobs:
        worker.cancel(job)


async def _next_event(jobs: list[Job], request: Request, worker: Worker) -> tuple[int, str, Any]:
    """The next event of a request's jobs, (choice, kind, value); cancels them if the client
    has gone (checked at each event and every POLL_S while waiting), which frees their slots
    and stops their decoding."""
    while True:
        if await request.is_disconnected():
            _cancel(jobs, worker)
            raise APIError(499, "the client closed the request.", "client_closed")
        try:
            return await asyncio.wait_for(jobs[0].events.get(), POLL_S)
        except asyncio.TimeoutError:
            pass


@dataclass
class _Reply:
    """What a request's response is built from: its jobs and, as they finish, their results."""

    jobs: list[Job]
    worker: Worker
    rid: str
    model: str
    prompt_tokens: int
    results: dict = field(default_factory=dict)  # choice → Result
    shown: dict = field(default_factory=dict)  # choice → its text streamed so far ("auto")

    @property
    def plan(self) -> Plan:
        return self.jobs[0].plan

    def choice(self, index: int) -> dict:
        result = self.results[index]
        msg, finish = message(self.plan, result)
        vocab = self.worker.gen.vocab
        return {
            "index": index,
            "message": msg,
            "logprobs": logprobs(result, vocab),
            "finish_reason": finish,
            "budget_shaped": result.finish_reason == "budget",  # extension (OPENAI_FINISH)
        }

    def usage(self) -> dict:
        return usage(self.prompt_tokens, [self.results[i] for i in sorted(self.results)])


async def _complete(reply: _Reply, request: Request) -> dict:
    while len(reply.results) < len(reply.jobs):
        index, kind, value = await _next_event(reply.jobs, request, reply.worker)
        if kind == "error":
            _cancel(reply.jobs, reply.worker)
            raise value
        if kind == "done":
            reply.results[index] = value
    return {
        "id": reply.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model,
        "choices": [reply.choice(i) for i in range(len(reply.jobs))],
        "usage": reply.usage(),
    }


async def _sse(reply: _Reply, request: Request) -> AsyncIterator[str]:
    """Each choice's committed text as it comes (its chunks name its index); a tool call comes
    whole at the end (it is parsed first), the log-probs with a choice's last chunk, the usage
    with the request's last."""
    ended, rid, model, tool = False, reply.rid, reply.model, reply.plan.tool
    try:
        for i in range(len(reply.jobs)):
            yield chunk(rid, model, i, {"role": "assistant", "content": ""})
        while len(reply.results) < len(reply.jobs):
            index, kind, value = await _next_event(reply.jobs, request, reply.worker)
            if kind == "piece" and tool is None:
                yield chunk(rid, model, index, {"content": value})
            elif kind == "piece" and tool == AUTO and (text := _before_calls(reply, index, value)):
                yield chunk(rid, model, index, {"content": text})
            elif kind == "error":  # after the headers: reported in the stream, then closed
                ended = True
                yield f"data: {json.dumps({'error': {'message': value.message}})}\n\n"
                return
            elif kind == "done":
                reply.results[index] = value
                for part in _last_chunks(reply, index):
                    yield part
        ended = True
        yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client left early: stop decoding, free the slots
            _cancel(reply.jobs, reply.worker)


def _before_calls(reply: _Reply, index: int, piece: str) -> str:
    """The new text of an "auto" reply that may be streamed: up to its first call, less a tail
    that may begin OPEN (shown once the next piece says it does not)."""
    seen, sent = reply.shown.get(index, ("", 0))
    seen += piece
    end = seen.find(OPEN)
    end = len(seen) - held_prefix(seen, OPEN) if end == -1 else end
    reply.shown[index] = (seen, max(sent, end))
    return seen[sent:end]


def _last_chunks(reply: _Reply, index: int) -> list[str]:
    """A finished choice's closing chunks: its tool call (or a cut tool reply as text), then
    its finish_reason and log-probs (and the usage once every choice is done)."""
    choice, result, (rid, model) = (
        reply.choice(index),
        reply.results[index],
        (reply.rid, reply.model),
    )
    parts = []
    calls = choice["message"].get("tool_calls")
    if reply.plan.tool == AUTO and not calls:  # the text held back, if any
        _, sent = reply.shown.get(index, ("", 0))
        if rest := result.text[sent:]:
            parts.append(chunk(rid, model, index, {"content": rest}))
    if calls:
        deltas = [{"index": i, **c} for i, c in enumerate(calls)]
        parts.append(chunk(rid, model, index, {"tool_calls": deltas}))
    elif reply.plan.tool not in (None, AUTO):  # a cut forced call is shown as text
        parts.append(chunk(rid, model, index, {"content": result.text}))
    extra = {"usage": reply.usage()} if len(reply.results) == len(reply.jobs) else {}
    if choice["logprobs"] is not None:
        extra["logprobs"] = choice["logprobs"]
    extra["budget_shaped"] = choice["budget_shaped"]
    parts.append(chunk(rid, model, index, {}, choice["finish_reason"], **extra))
    return parts


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until interrupted; the model loads in the background (503 until then)."""
    import uvicorn

    uvicorn.run(create_app(config), host=host, port=port, log_level="warning")
