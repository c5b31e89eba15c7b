"""The library's front door: ``Generator`` (a target, its tokenizer and a drafter, ready to
generate under constraints), ``Request`` (one request's prompt, constraint and settings: the one
request type of generate, stream, the batches, corpus jobs and the server) and ``Result``."""

from __future__ import annotations

import codecs
import contextlib
import copy
import dataclasses
import functools
import json
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .constraints import Constraint, compile_constraint, token_vocabulary
from .decoding import cost, loop
from .decoding.drafters import (
    DRAFTER_MEMBERS,
    CompositeDrafter,
    Drafter,
    logits_width,
    model_drafter,
)
from .decoding.head import DraftHead, HeadDraft, has_shipped_head, load_head, shipped_head
from .decoding.loop import AdaptiveK, Round, Row, Stats, TokenLogprob
from .decoding.sample import SamplingConfig
from .decoding.text import MAX_STOP_STRINGS, ReplyText, stop_problem, stop_strings
from .errors import (
    BudgetMaskWarning,
    BudgetTooSmall,
    ConstraintError,
    GenerationInputError,
    VocabularyMismatch,
    WeightsError,
)
from .model import DEFAULT_MODEL, describe_weights, kv, load_model, quantize_int8
from .model import skinny_matmul as use_skinny

__all__ = ["Generator", "Request", "Result"]

# Below this temperature logits / T overflows float32 (the policy would see inf − inf = nan);
# such a temperature is greedy in all but name.
MIN_TEMPERATURE = 1e-4
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class Request:
    """One generation request. ``prompt``: a string (fed as is), chat messages (the chat template
    is applied) or token ids. Exactly one of ``schema`` (a dict, JSON text, a .json path, a
    Pydantic class or True: any JSON value), ``regex`` and ``grammar`` (Lark or GBNF text)."""

    prompt: Any
    schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: a fresh one
    speculative: bool = True  # False: the masked baseline, through the same loop
    num_draft_tokens: int = 4  # draft-model tokens per round (free drafts are not counted)
    adaptive_k: bool = False  # choose that number each round from measured acceptance and cost
    # the reply ends before the first of these (up to 4) that the constraint lets it end at
    stop: str | list[str] | None = None
    logprobs: bool = False  # Result.logprobs: each token's log-prob (decoding/loop.TokenLogprob)
    top_logprobs: int = 0  # and this many of the most likely tokens at its position (0..20)
    # only tokens after which the reply can still finish within max_new_tokens: never cut
    budget_mask: bool = True
    # no token that completes an immediate repeat of a stretch of 8 bytes or more (an array
    # item, a phrase): small models' loops end; it changes the distribution (decoding/repeats)
    loop_guard: bool = False

    @classmethod
    def of(cls, request, index: int | None = None) -> Request:
        """A Request from a Request or a dict of its fields; an unknown field is named."""
        if isinstance(request, cls):
            return request
        where = f"request {index}: " if index is not None else ""
        if not isinstance(request, dict) or "prompt" not in request:
            raise GenerationInputError(f"{where}a request is a dict with at least a 'prompt'.")
        unknown = sorted(set(request) - set(FIELDS))
        if unknown:
            raise GenerationInputError(
                f"{where}unknown field(s) {', '.join(unknown)}; a request takes "
                f"{', '.join(FIELDS)}."
            )
        return cls(**request)

    def sampling(self) -> SamplingConfig:
        """The sampling settings, checked (before any model work): a GenerationInputError names
        every bad value."""
        problems = setting_problems({f: getattr(self, f) for f in SETTINGS})
        if problems:
            raise GenerationInputError("; ".join(problems) + ".")
        if self.top_logprobs and not self.logprobs:
            raise GenerationInputError("top_logprobs needs logprobs=True.")
        return SamplingConfig(self.temperature, self.top_k, self.top_p)

    @property
    def constraint(self) -> dict:
        """The given constraint as compile's keywords."""
        return {
            k: getattr(self, k)
            for k in ("schema", "regex", "grammar")
            if getattr(self, k) is not None
        }


FIELDS = tuple(f.name for f in dataclasses.fields(Request))

# The settings checked before any model work, each with what it must be.
SETTINGS = {
    "temperature": (
        lambda t: t == 0 or MIN_TEMPERATURE <= t < math.inf,
        f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (lower ones are greedy "
        "in effect: pass 0)",
    ),
    "top_k": (lambda k: k is None or k >= 1, "must be >= 1"),
    "top_p": (lambda p: p is None or 0 < p <= 1, "must be in (0, 1]"),
    "num_draft_tokens": (lambda n: n >= 0, "must be >= 0"),
    "max_new_tokens": (lambda n: n >= 1, "must be >= 1"),
    "seed": (
        lambda s: s is None or (isinstance(s, int) and 0 <= s < 2**64),
        "must be in [0, 2**64)",
    ),
    "stop": (
        lambda s: stop_problem(s) is None,
        f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings",
    ),
    "top_logprobs": (
        lambda k: isinstance(k, int) and 0 <= k <= MAX_TOP_LOGPROBS,
        f"must be in 0..{MAX_TOP_LOGPROBS}",
    ),
}


def setting_problems(values: dict, label=lambda field: f"{field}=") -> list[str]:
    """What is wrong with ``values`` (some of SETTINGS' fields), one line each, each field named
    by ``label`` (the CLI names its flags)."""
    return [
        f"{label(field)}{values[field]} {what}"
        for field, (ok, what) in SETTINGS.items()
        if field in values and not ok(values[field])
    ]


@dataclass(frozen=True)
class Result:
    text: str  # the reply, before the stop string that ended it (if one did)
    value: Any  # the parsed JSON when a schema was given and generation stopped
    token_ids: list[int]  # generated ids, EOS excluded (a stop string's tokens included)
    # "stop" (EOS or a stop string, where the text is complete); "budget" (the same, after the
    # budget mask removed a token the model drew: made to finish in time) | "length" (cut)
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # one per token_ids' token, if asked for


def _one_at_a_time(method):
    """Run a Generator method holding its lock (see the Generator docstring)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class Generator:
    """A target model (and optionally a drafter) ready to generate under constraints.

    Safe to share between threads: requests run one at a time (a lock; the drafters keep
    per-request state, and concurrent requests on one model would gain nothing on a CPU)."""

    def __init__(
        self, target, tokenizer, draft=None, *, whitespace: str = "", open_objects: bool = False
    ):
        """``draft``: a transformers causal LM sharing the target's vocabulary, a trained
        DraftHead, a Drafter (``begin``, ``propose``, ``observe``, ``uses_features``), or None
        (masked baseline).
        ``whitespace``: regex allowed between JSON tokens; the default "" emits compact JSON.
        ``open_objects``: objects that declare properties may also have others where the
        schema says nothing about them (JSON Schema's meaning; the default closes them: the
        model then cannot invent keys, docs/schemas.md)."""
        self.target, self.tokenizer = target.eval(), tokenizer
        self.vocab = token_vocabulary(tokenizer)
        self.width = logits_width(target)  # may be padded above len(tokenizer)
        if self.width < len(tokenizer):
            raise VocabularyMismatch(
                f"the target's logits width {self.width} is smaller than the "
                f"tokenizer's {len(tokenizer)} tokens: pass its own tokenizer."
            )
        self.drafter = _as_drafter(draft, target, len(tokenizer), self.width)
        self.whitespace, self.open_objects = whitespace, open_objects
        self.context = kv.context_of(target)
        self._lock = threading.RLock()  # one request at a time: see the class docstring

    @classmethod
    def from_pretrained(
        cls,
        target: str = DEFAULT_MODEL,
        draft: str | None = "auto",
        weights: str = "auto",
        dtype: torch.dtype = torch.float32,
        skinny_matmul: bool = True,
        **kwargs,
    ) -> Generator:
        """Load a built-in model name, a local path or a hub id. ``draft``: one of DRAFTS (no
        extra download), a draft head file (.safetensors) or a draft model name/path sharing
        the target's tokenizer. ``weights``: one of models.WEIGHTS; "auto" runs the built-in
        model's own 4-bit blocks where this machine runs them faster (measured once, cached).
        ``skinny_matmul``: on the CPU, float verify passes (2–32 tokens) use
        model.models.SkinnyLinear, cheaper (git show 8fe3c79:docs/measurements.md); one-token
        steps are unchanged."""
        if draft in ("int8", "bf16") and weights != "float":  # copies of a transformers target
            if weights != "auto":
                raise WeightsError(
                    f"draft={draft!r} copies a float target, and weights="
                    f"{weights!r} is not one: pass weights='float', or use "
                    "draft='head' or 'lookup'."
                )
            weights = "float"
        if draft == "head":
            shipped_head(target)  # a clear DraftHeadError before loading, where none ships
        model, tokenizer = load_model(target, dtype, weights)
        if draft == "auto":  # the head pays on the float target, not on the 4-bit one (DRAFTS)
            quantized = getattr(model, "weights", "float") != "float"
            draft = "head" if has_shipped_head(target) and not quantized else "lookup"
        head = shipped_head(target) if draft == "head" else draft if _is_head_file(draft) else None
        if head is not None:
            draft = load_head(model, token_vocabulary(tokenizer), head)
        else:
            draft = _named_draft(draft, model, dtype)  # copies of the target first: int8
        if skinny_matmul and next(model.parameters()).device.type == "cpu":  # quantizes only
            use_skinny(model)  # plain nn.Linear
        gen = cls(model, tokenizer, draft=draft, **kwargs)
        gen.weights_choice = describe_weights(target, weights, gen.weights, model)
        cost.pass_cost(model)  # a request's table, measured at load where none is stored
        return gen

    @property
    def weights(self) -> str:
        """Which forward runs the target: "int4"/"int8" (the compact forward) or "float"."""
        return getattr(self.target, "weights", "float")

    @_one_at_a_time
    def compile(
        self, schema=None, regex: str | None = None, grammar: str | None = None
    ) -> Constraint:
        """The compiled constraint for this tokenizer: a JSON Schema, a regex or a Lark/GBNF
        grammar (its text), exactly one."""
        given = {"schema": schema, "regex": regex, "grammar": grammar}
        return compile_constraint(
            self.vocab, self.width, self.whitespace, self.open_objects, **given
        )

    @_one_at_a_time
    def generate(
        self,
        prompt,
        *,
        on_round: Callable[[Round], None] | None = None,
        drafter: Drafter | None = None,
        **settings,
    ) -> Result:
        """Text the constraint accepts, distributed exactly as plain masked sampling.
        ``prompt``: a Request, or its prompt with the other fields of Request as keywords
        (``schema=``, ``temperature=``, ...). ``on_round``: called with each Round.
        ``drafter``: this request's drafter instead of the Generator's."""
        *_, result = self.stream(prompt, on_round=on_round, drafter=drafter, **settings)
        return result

    def stream(
        self,
        prompt,
        *,
        on_round: Callable[[Round], None] | None = None,
        drafter: Drafter | None = None,
        **settings,
    ) -> Iterator[str | Result]:
        """``generate`` as it happens: the committed text in pieces (``str``), then the
        ``Result``. Only committed tokens are shown, never a draft that may still be rolled back,
        and a character split across tokens comes out whole. The arguments are checked and the
        constraint compiled now; decoding runs while you iterate and stops when you close it.
        While it runs it holds the Generator's lock: exhaust or close it."""
        request = _request(prompt, settings)
        drafter = self.drafter if drafter is None else _checked_drafter(drafter)
        row = self.row(request, drafter=drafter)
        return self._pieces(row, on_round)

    def _pieces(self, row: Row, on_round) -> Iterator[str | Result]:
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a split character
        # the lock is held while decoding runs: released when the iteration ends or is closed;
        # closing the pieces stops the decode loop too
        with self._lock, contextlib.closing(loop.decode(self.target, [row], 1)) as rounds:
            for _, r in rounds:
                if on_round is not None:
                    on_round(r)
                if piece := utf8.decode(row.reply.unsent(row.finished)):
                    yield piece
        if tail := utf8.decode(b"", final=True):  # only an incomplete character at "length"
            yield tail
        yield self.result(row)

    @_one_at_a_time
    def generate_batch(
        self, requests: Iterable[Request | dict], batch_size: int = 8
    ) -> list[Result]:
        """generate() over many requests (Requests, or dicts of their fields), ``batch_size`` of
        them decoded together (one target forward per round for all of them), results in order.
        Every request is checked before any model work: the first bad one raises. Drafts:
        grammar-forced tokens and prompt lookup per row (a draft head or model drafts one
        request at a time)."""
        rows = [self.row(r, i, batched=True) for i, r in enumerate(requests)]
        results: list[Result] = [None] * len(rows)  # type: ignore[list-item]
        cost.pass_cost(self.target, _batch_size(batch_size))  # before the first round
        for row, _ in loop.decode(self.target, rows, _batch_size(batch_size)):
            if row.finished:
                results[row.index] = self.result(row)
                row.cache = None  # its buffers serve a later row's cache (llama.CachePool)
        return results

    def batch(
        self, requests: Iterable[Request | dict], batch_size: int = 8
    ) -> Iterator[tuple[int, Result | ValueError]]:
        """As generate_batch, for corpus jobs: yields (index, Result) as rows finish; a bad
        request yields (index, its error: one of the package's documented errors) and the
        others go on."""
        failed: list[tuple[int, ValueError]] = []

        def rows():
            for i, request in enumerate(requests):
                try:
                    yield self.row(request, i, batched=True)
                except BAD_REQUEST_ERRORS as err:
                    failed.append((i, err))

        with self._lock:  # released when the iteration ends or is closed
            cost.pass_cost(self.target, _batch_size(batch_size))  # before the first round
            for row, _ in loop.decode(self.target, rows(), _batch_size(batch_size)):
                yield from _drain(failed)
                if row.finished:
                    yield row.index, self.result(row)
                    row.cache = None
            yield from _drain(failed)

    def row(
        self, request: Request | dict, index: int = 0, drafter: Drafter | None = None, batched=False
    ) -> Row:
        """The request as a decode loop's Row, checked (before any model work) and its constraint
        compiled; for callers that run rounds themselves (loop.admit, then loop.step until it is
        finished, then ``result``: the server joins requests into a running batch this way).
        ``drafter``: the Generator's by default; ``batched``: a row of a batch, which gets its
        own copy of the forced and lookup drafts (a draft model drafts one request at a time)."""
        request = Request.of(request, index)
        sampling = request.sampling()
        prompt_ids = self.encode_prompt(request.prompt)
        constraint = self.compile(**request.constraint)
        generator = torch.Generator(device=next(self.target.parameters()).device)
        generator.manual_seed(request.seed if request.seed is not None else torch.seed())
        max_new = min(request.max_new_tokens, self.context - len(prompt_ids))  # then "length"
        budget_mask = request.budget_mask and _fits_budget(request, constraint, max_new)
        drafter = self.drafter if drafter is None else drafter
        if batched:
            drafter = _row_drafter(drafter)
        adaptive = AdaptiveK(max(request.num_draft_tokens, 1)) if request.adaptive_k else None
        return Row(
            prompt_ids,
            constraint,
            sampling,
            generator,
            drafter if request.speculative else None,
            max_new,
            request.num_draft_tokens,
            adaptive,
            index,
            ReplyText(self.vocab, constraint, stop_strings(request.stop)),
            request.top_logprobs if request.logprobs else None,
            budget_mask,
            loop_guard=request.loop_guard,
        )

    def result(self, row: Row) -> Result:
        """The Result of a finished Row."""
        eos = self.vocab.eos_id
        token_ids = [t for t in row.output if t != eos]
        text = row.reply.text.decode("utf-8", errors="replace")
        finish = row.finish_reason
        parse = row.constraint.source == "schema" and finish in ("stop", "budget")
        value = json.loads(text) if parse else None
        logprobs = [s for s in row.scores if s.token != eos] if row.logprobs is not None else None
        return Result(text, value, token_ids, finish, row.stats, logprobs)

    def encode_prompt(self, prompt) -> list[int]:
        """The token ids generate() feeds for ``prompt`` (str, chat messages or ids), checked."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            _check_messages(prompt)
            text = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < len(self.tokenizer) for t in ids):
                raise GenerationInputError(
                    f"prompt token ids must lie in [0, {len(self.tokenizer)})."
                )
        else:
            raise GenerationInputError(
                "prompt must be a str, a list of chat messages "
                "({'role': ..., 'content': ...}) or a list of token ids."
            )
        if not ids:
            raise GenerationInputError(
                "the prompt is empty: give the model something to respond to."
            )
        if len(ids) >= self.context:
            stated = getattr(self.target.config, "max_position_embeddings", None) or self.context
            why = (
                f" of the {stated} it states: the compact forward runs LongRoPE's short factors "
                "only, up to original_max_position_embeddings (weights='float' runs the long ones)"
                if stated > self.context
                else ""
            )
            raise GenerationInputError(
                f"the prompt has {len(ids)} tokens but the model's context holds {self.context}"
                f"{why}: shorten the prompt."
            )
        return ids


BAD_REQUEST_ERRORS = (ConstraintError, GenerationInputError)


def _fits_budget(request: Request, constraint: Constraint, max_new: int) -> bool:
    """Whether the budget mask can run (a completion of the empty reply was found: see
    Constraint.completion), after checking that the reply's shortest form fits ``max_new``."""
    shortest = constraint.completion(constraint.initial_state)
    if shortest is None:  # the budget mask cannot vouch for any reply: off, and said so
        warnings.warn(
            f"no way to finish a reply was found for this {constraint.source}: the budget mask "
            "is off for this request, and the reply may be cut at max_new_tokens.",
            BudgetMaskWarning,
            stacklevel=4,
        )
        return False
    if shortest.tokens > max_new:
        given = (
            f"max_new_tokens={request.max_new_tokens}"
            if max_new == request.max_new_tokens
            else f"the context's room after the prompt ({max_new} tokens)"
        )
        text = shortest.text.decode(errors="replace")
        raise BudgetTooSmall(
            f"{given} is below the {shortest.tokens} tokens of the shortest reply found for this "
            f"{constraint.source} ({text!r}, then the end of text): raise max_new_tokens to "
            f"{shortest.tokens} at least, or pass budget_mask=False to have the reply cut.",
            max_new,
            shortest.tokens,
            text,
        )
    return True


def _request(prompt, settings: dict) -> Request:
    if isinstance(prompt, Request):
        return dataclasses.replace(prompt, **settings) if settings else prompt
    return Request.of({"prompt": prompt, **settings})


def _row_drafter(drafter: Drafter | None) -> Drafter | None:
    """A batch row's own drafter: forced tokens and prompt lookup keep per-request state, so
    each row gets a fresh copy; a draft model or head drafts one request at a time, so a row
    keeps only its forced and lookup tokens."""
    if not isinstance(drafter, CompositeDrafter):
        return None
    return dataclasses.replace(drafter, model=None, target_tokens=set())


def _batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GenerationInputError(f"batch_size={batch_size!r} must be an int >= 1.")
    return batch_size


def _drain(failed: list):
    while failed:
        yield failed.pop(0)


# Drafts that need no download. "auto" is what measured fastest on the default model on a 2-core
# CPU (git show 8fe3c79:docs/measurements.md): the trained head with forced tokens and prompt lookup, else lookup.
DRAFTS = {
    "auto": 'the fastest measured here: "head" where a head ships for a float target '
    "(the default model with weights='float'), else \"lookup\" (the 4-bit "
    "target's step is cheap enough that a head step costs 0.7 of it)",
    "lookup": "grammar-forced tokens + prompt lookup (free drafts, no draft model)",
    "int8": "a dynamically int8-quantized copy of the target, plus forced + lookup",
    "bf16": "a bfloat16 copy of the target, plus forced + lookup",
    "head": "the draft head trained for the target (EAGLE-style), plus forced + lookup; "
    "it stops drafting when its chain turns unlikely",
    "none": "no drafts: the masked baseline",
}
# The head's drafting stops once its chain's estimated chance of full acceptance drops below this
# (thresholds 0.1-0.7 measured within a few % of each other: git show 8fe3c79:docs/measurements.md).
HEAD_MIN_CONFIDENCE = 0.3


# The longest draft a CompositeDrafter proposes to a 4-bit (or 8-bit) target: its kernel runs
# inputs in blocks of 4 rows and each new token attends by itself, so wide verify passes cost
# several one-token steps. Tuned on 20 extract requests (--seed 1 and 2; the reports use --seed 0,
# benchmarks/results/tuning-fast): caps of 2 / 3 / 4 / 5 / 7 ran lookup at 1.46 / 1.50 / 1.40 /
# 1.43 / 1.40× (seed 1) and 1.38 / 1.44 / 1.41 / 1.43 / 1.44× (seed 2) the baseline greedy; at
# T = 0.7 caps 3 / 5 / 7 ran 1.35 / 1.23 / 1.39× and 1.31 / 1.20 / 1.22×. The float target keeps
# CompositeDrafter's default (24).
QUANTIZED_MAX_DRAFT = 3


def _draft_limits(target) -> dict:
    return (
        {"max_draft": QUANTIZED_MAX_DRAFT} if getattr(target, "weights", "float") != "float" else {}
    )


def _named_draft(draft: str | None, model, dtype: torch.dtype):
    if draft in (None, "none"):
        return None
    if draft == "lookup":
        return CompositeDrafter(model=None, **_draft_limits(model))
    if draft == "int8":
        return quantize_int8(model)
    if draft == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16)
    # a draft model on the fast path where the target is on it (weights="auto": a GGUF's own
    # blocks); exact either way, the acceptance rule corrects whatever the draft's numerics
    fast = getattr(model, "weights", "float") != "float" and dtype == torch.float32
    return load_model(draft, dtype, "auto" if fast else "float")[0]


def _is_head_file(draft) -> bool:
    return isinstance(draft, (str, Path)) and str(draft).endswith(".safetensors")


def _as_drafter(draft, target, vocab_len: int, width: int) -> Drafter | None:
    if draft is None:
        return None
    if hasattr(draft, "propose"):
        return _checked_drafter(draft)
    if isinstance(draft, DraftHead):
        return CompositeDrafter(
            HeadDraft(draft.eval(), target),
            min_confidence=HEAD_MIN_CONFIDENCE,
            **_draft_limits(target),
        )
    draft_width = logits_width(draft)
    if draft_width < vocab_len:
        raise VocabularyMismatch(
            f"the draft model predicts {draft_width} tokens but the target's tokenizer has "
            f"{vocab_len}: a draft must share the target's vocabulary (same tokenizer family)."
        )
    return model_drafter(draft.eval(), width, **_draft_limits(target))


def _checked_drafter(drafter) -> Drafter:
    missing = [name for name in DRAFTER_MEMBERS if not hasattr(drafter, name)]
    if missing:
        raise TypeError(
            f"{type(drafter).__name__} lacks {', '.join(missing)} of the Drafter "
            "protocol (constrained_spec.Drafter): add them (no-ops where it "
            "has nothing to do)."
        )
    return drafter


def _check_messages(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise GenerationInputError(
                f"chat message {i} is {str(m)[:80]}: each message needs a 'role' and a "
                "'content' string, e.g. {'role': 'user', 'content': 'Hi'}."
            )
