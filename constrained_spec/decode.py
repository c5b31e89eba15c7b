"""The decode loop: draft → verify (one target forward) → commit → roll back the rest."""

from __future__ import annotations

import codecs
import contextlib
import copy
import functools
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import cache as kv
from .compile import FINISHED, Constraint
from .draft import (
    DRAFTER_MEMBERS,
    EMPTY_DRAFT,
    CompositeDrafter,
    Draft,
    Drafter,
    logits_width,
    model_drafter,
)
from .errors import ConstraintError, GenerationInputError, VocabularyMismatch, WeightsError
from .guidance import check_engine, compile_constraint
from .head import DraftHead, HeadDraft, has_shipped_head, load_head, shipped_head
from .models import DEFAULT_MODEL
from .models import cache_dir as default_cache_dir
from .sample import SamplingConfig, one_hot, policy, verify_greedy, verify_sampled
from .schema import load_schema
from .vocab import token_vocabulary


@dataclass(frozen=True)
class Round:
    """What one round committed; passed to ``on_round`` (only committed tokens, never drafts
    that were rolled back, except as ``rejected`` for display)."""

    drafted: list[int]  # the draft proposed this round
    accepted: int  # how many of its tokens the target accepted
    token: int  # the target's own token: correction (accepted < drafted) or bonus
    committed: list[int]  # drafted[:accepted] + [token], cut after EOS / at max_new_tokens
    sources: tuple[str, ...] = ()  # each drafted token's source: forced/grammar/lookup/model


@dataclass
class Stats:
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # histogram: rounds by accepted n
    accepted_by_position: list[int] = field(default_factory=list)  # drafts accepted at index i
    drafted_by_position: list[int] = field(default_factory=list)
    drafted_by_source: dict[str, int] = field(default_factory=dict)  # forced/grammar/lookup/model
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens copied from a kept prompt (llama.PromptCache)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ttft_s: float = 0.0  # prompt in → first committed token
    total_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, draft: Draft, accepted: int) -> None:
        drafted = len(draft)
        self.target_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        for i, source in enumerate(draft.sources):
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + 1
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + (
                i < accepted
            )
        for hist, n in (
            (self.accepted_lengths, accepted + 1),
            (self.drafted_by_position, drafted),
            (self.accepted_by_position, accepted),
        ):
            hist.extend([0] * (n - len(hist)))
        self.accepted_lengths[accepted] += 1
        for i in range(drafted):
            self.drafted_by_position[i] += 1
        for i in range(accepted):
            self.accepted_by_position[i] += 1


@dataclass(frozen=True)
class Result:
    text: str
    value: Any  # the parsed JSON when a schema was given and generation stopped
    token_ids: list[int]  # generated ids, EOS excluded
    finish_reason: str  # "stop" (EOS in an accepting state) | "length" (max_new_tokens)
    stats: Stats


def speculative_step(
    target,
    cache,
    constraint: Constraint,
    tokens: list[int],
    state: int,
    draft: Draft,
    sampling: SamplingConfig,
    generator: torch.Generator,
    features: bool = False,
):
    """One round: ONE target forward over [last committed] + draft, exact acceptance, commit.

    Returns (accepted, token, state, features): the draft's accepted length, the target's own
    token, the automaton state after both, and (if asked) the target's features over the fed
    positions. The caller crops the cache to the committed tokens.
    A draft is cut at its first illegal token (drafters should not propose one; sampled drafts
    must come from a masked q, since cutting an unmasked sampled draft would bias the output)."""
    draft, states = legal_states(constraint, state, draft)
    device = next(target.parameters()).device
    masks = constraint.masks(states, device)  # (k+1, V): the legal tokens at each position
    out = kv.forward(target, cache, [tokens[-1]] + draft.tokens, device, features, masks)
    logits, hidden = out if features else (out, None)  # (k+1, V), (k+1, d)
    n, token = torch.stack(verify(logits, masks, draft, sampling, generator)).tolist()
    return n, token, constraint.step(states[n], token), hidden  # .tolist(): the one host sync


def commit(tokens: list[int], cache, committed: list[int], eos_id: int) -> list[int]:
    """Append a round's accepted drafts + the target's token to ``tokens``, cut after an EOS (a
    draft may end in one: nothing after it counts), and crop ``cache`` to them (the rejected
    drafts' entries go). Returns what was committed."""
    if eos_id in committed:
        committed = committed[: committed.index(eos_id) + 1]
    tokens += committed
    kv.crop(cache, len(tokens) - 1)
    assert kv.cached_length(cache) == len(tokens) - 1, "target cache out of step"
    return committed


def legal_states(constraint: Constraint, state: int, draft: Draft) -> tuple[Draft, list[int]]:
    """The draft cut at its first illegal token, and the automaton states before each of its
    tokens and after the last (state_i = the state after draft[:i])."""
    states = [state]
    for token in draft.tokens:
        after = constraint.step(states[-1], token)
        if after is None:  # p(token) = 0: it could only be rejected, so the draft ends here
            return draft.truncate(len(states) - 1), states
        states.append(after)
    return draft, states


def verify(
    logits: torch.Tensor,
    masks: torch.Tensor,
    draft: Draft,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact acceptance rule on the target's logits (k+1, V) over [last committed] + draft,
    under the legal ``masks`` (k+1, V): (accepted length, the target's own token) as 0-d device
    tensors, no host sync."""
    device = logits.device
    draft_ids = torch.tensor(draft.tokens, dtype=torch.long, device=device)  # (k,)
    if sampling.greedy:
        return verify_greedy(logits, masks, draft_ids)
    target_probs = policy(logits, masks, sampling)  # (k+1, V)
    draft_probs = (
        draft.probs if draft.probs is not None else one_hot(draft.tokens, logits.shape[-1], device)
    )  # (k, V)
    return verify_sampled(target_probs, draft_probs, draft_ids, generator)


def decode(
    target,
    constraint: Constraint,
    prompt: list[int],
    drafter: Drafter | None,
    sampling: SamplingConfig,
    num_draft_tokens: int,
    max_new_tokens: int,
    generator: torch.Generator,
    on_round: Callable[[Round], None] | None = None,
    adaptive: AdaptiveK | None = None,
):
    """Generate until EOS or ``max_new_tokens``; returns (new token ids, finish_reason, stats)."""
    stats, output = Stats(), []
    for r in decode_rounds(
        target,
        constraint,
        prompt,
        drafter,
        sampling,
        num_draft_tokens,
        max_new_tokens,
        generator,
        stats,
        adaptive,
    ):
        output += r.committed
        if on_round is not None:
            on_round(r)
    return output, finish_reason(output, constraint), stats


def finish_reason(output: list[int], constraint: Constraint) -> str:
    """Why decoding ended: "stop" iff EOS was committed (legal only where the text is
    complete), else "length" (``max_new_tokens`` or the context)."""
    return "stop" if output[-1:] == [constraint.eos_id] else "length"


def decode_rounds(
    target,
    constraint: Constraint,
    prompt: list[int],
    drafter: Drafter | None,
    sampling: SamplingConfig,
    num_draft_tokens: int,
    max_new_tokens: int,
    generator: torch.Generator,
    stats: Stats,
    adaptive: AdaptiveK | None = None,
) -> Iterator[Round]:
    """The decode loop, one ``Round`` (committed tokens only) per target call; fills ``stats``.
    Decoding runs only while the caller iterates: closing the iterator stops it at once."""
    start = time.perf_counter()
    device = next(target.parameters()).device
    cache = kv.new_cache(target)
    features = drafter is not None and drafter.uses_features  # a trained head reads the target's
    prefill = torch.empty(0, 0, device=device) if features else None
    if len(prompt) > 1:  # the last prompt token opens round 1
        prefill, stats.cached_prompt_tokens = kv.prefill(
            target, cache, prompt[:-1], device, features
        )
    if drafter is not None:
        drafter.begin(prompt, prefill)
    stats.prefill_s = time.perf_counter() - start
    tokens, state = list(prompt), constraint.initial_state
    while state != FINISHED and (room := max_new_tokens - (len(tokens) - len(prompt))) > 0:
        k = adaptive.choose() if adaptive is not None else num_draft_tokens
        t0 = time.perf_counter()
        draft = (
            drafter.propose(tokens, state, constraint, k, sampling, generator).truncate(room - 1)
            if drafter is not None and room > 1
            else EMPTY_DRAFT
        )
        t1 = time.perf_counter()
        n, token, state, hidden = speculative_step(
            target, cache, constraint, tokens, state, draft, sampling, generator, features
        )
        committed = commit(tokens, cache, draft.tokens[:n] + [token], constraint.eos_id)
        state = FINISHED if committed[-1] == constraint.eos_id else state
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.record(draft, n)
        if adaptive is not None:
            adaptive.update(draft, n, t1 - t0, t2 - t1)
        if drafter is not None:
            drafter.observe(committed, hidden[: len(committed)] if features else None)
        if stats.target_calls == 1:
            stats.ttft_s = t2 - start
        yield Round(draft.tokens, n, token, committed, draft.sources)
    stats.total_s = time.perf_counter() - start


@dataclass
class AdaptiveK:
    """Draft-model tokens per round, chosen to maximise the expected tokens per unit of cost
    (1 − α^(k+1)) / ((1 − α)(k·c + 1)) (Leviathan et al. 2023, §3.4), from running estimates of
    α (acceptance of a model-drafted token) and c (draft step cost / target verify cost)."""

    k_max: int
    alpha: float = 0.7  # prior until the first rounds are seen
    cost: float = 0.4  # prior: an int8 copy of the target costs ≈ 0.4 of a target step
    decay: float = 0.8  # weight of the past in the running estimates

    def choose(self) -> int:
        a, c = min(self.alpha, 0.99), self.cost
        gain = lambda k: (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))
        return max(range(1, self.k_max + 1), key=gain)  # k ≥ 1 keeps α observable

    def update(self, draft: Draft, accepted: int, draft_s: float, verify_s: float) -> None:
        model_positions = [i for i, s in enumerate(draft.sources) if s == "model"]
        for i in model_positions:
            if i <= accepted:  # reached: every token before it was accepted
                self.alpha = self.decay * self.alpha + (1 - self.decay) * (i < accepted)
        if model_positions and verify_s > 0:
            step_cost = draft_s / len(model_positions) / verify_s
            self.cost = self.decay * self.cost + (1 - self.decay) * step_cost


def _one_at_a_time(method):
    """Run a Generator method holding its lock (see the Generator docstring)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class _Prepared(NamedTuple):
    sampling: SamplingConfig
    prompt_ids: list[int]
    constraint: Constraint
    generator: torch.Generator
    max_new_tokens: int  # clamped to the context left after the prompt
    parse_json: bool  # a schema: the Result carries the parsed value


class Generator:
    """A target model (and optionally a drafter) ready to generate under constraints.

    Safe to share between threads: requests run one at a time (a lock; the drafters keep
    per-request state, and concurrent requests on one model would gain nothing on a CPU)."""

    def __init__(
        self,
        target,
        tokenizer,
        draft=None,
        *,
        whitespace: str = "",
        cache_dir: str | Path | None = None,
        engine: str = "auto",
        open_objects: bool = False,
    ):
        """``draft``: a transformers causal LM sharing the target's vocabulary, a trained
        DraftHead, a Drafter (``begin``, ``propose``, ``observe``, ``uses_features``), or None
        (masked baseline).
        ``whitespace``: regex allowed between JSON tokens; the default "" emits compact JSON.
        ``engine``: what compiles constraints, one of guidance.ENGINES.
        ``open_objects``: objects that declare properties may also have others where the
        schema says nothing about them (JSON Schema's meaning; the default closes them: the
        model then cannot invent keys, docs/schemas.md). The regex engine closes them always."""
        self.target, self.tokenizer = target.eval(), tokenizer
        self.vocab = token_vocabulary(tokenizer)
        self.width = logits_width(target)  # may be padded above len(tokenizer)
        if self.width < len(tokenizer):
            raise VocabularyMismatch(
                f"the target's logits width {self.width} is smaller than the "
                f"tokenizer's {len(tokenizer)} tokens: pass its own tokenizer."
            )
        self.drafter = _as_drafter(draft, target, len(tokenizer), self.width)
        self.whitespace = whitespace
        self.engine = check_engine(engine)  # an unknown one fails here, not at the first request
        self.open_objects = open_objects
        self.context = getattr(target.config, "max_position_embeddings", None) or 2**31
        self.cache_dir = default_cache_dir(cache_dir)
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
        models.SkinnyLinear, cheaper (docs/measurements.md); one-token steps are unchanged."""
        from .models import describe_weights, load_model
        from .models import skinny_matmul as use_skinny

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
        schema = load_schema(schema) if schema is not None else None
        return compile_constraint(
            self.engine,
            self.vocab,
            self.width,
            self.cache_dir,
            self.whitespace,
            self.open_objects,
            schema=schema,
            regex=regex,
            grammar=grammar,
        )

    @_one_at_a_time
    def generate(
        self,
        prompt,
        schema=None,
        regex: str | None = None,
        grammar: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_draft_tokens: int = 4,
        speculative: bool = True,
        seed: int | None = None,
        adaptive_k: bool = False,
        on_round: Callable[[Round], None] | None = None,
        drafter: Drafter | None = None,
    ) -> Result:
        """Text the constraint accepts, distributed exactly as plain masked sampling.
        ``drafter``: this request's drafter instead of the Generator's (a Drafter; with
        ``speculative=False`` none is used)."""
        *_, result = self.stream(
            prompt,
            schema=schema,
            regex=regex,
            grammar=grammar,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_draft_tokens=num_draft_tokens,
            speculative=speculative,
            seed=seed,
            adaptive_k=adaptive_k,
            on_round=on_round,
            drafter=drafter,
        )
        return result

    def stream(
        self,
        prompt,
        schema=None,
        regex: str | None = None,
        grammar: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_draft_tokens: int = 4,
        speculative: bool = True,
        seed: int | None = None,
        adaptive_k: bool = False,
        on_round: Callable[[Round], None] | None = None,
        drafter: Drafter | None = None,
    ) -> Iterator[str | Result]:
        """``generate`` as it happens: the committed text in pieces (``str``), then the
        ``Result``. Only committed tokens are shown, never a draft that may still be rolled back,
        and a character split across tokens comes out whole. The arguments are checked and the
        constraint compiled now; decoding runs while you iterate and stops when you close it.
        While it runs it holds the Generator's lock: exhaust or close it."""
        p = self._prepare(
            prompt,
            schema,
            regex,
            grammar,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            num_draft_tokens,
        )
        drafter = self.drafter if drafter is None else _checked_drafter(drafter)
        drafter = drafter if speculative else None
        adaptive = AdaptiveK(max(num_draft_tokens, 1)) if adaptive_k else None
        stats = Stats()
        rounds = decode_rounds(
            self.target,
            p.constraint,
            p.prompt_ids,
            drafter,
            p.sampling,
            num_draft_tokens,
            p.max_new_tokens,
            p.generator,
            stats,
            adaptive,
        )
        return self._pieces(rounds, p.constraint, stats, p.parse_json, on_round)

    def _prepare(
        self,
        prompt,
        schema,
        regex,
        grammar,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        seed,
        num_draft_tokens=0,
    ) -> _Prepared:
        """A request's arguments checked (before any model work) and its constraint compiled."""
        sampling = _check_sampling(temperature, top_k, top_p, num_draft_tokens, max_new_tokens)
        _check_seed(seed)
        prompt_ids = self.encode_prompt(prompt)
        schema = load_schema(schema) if schema is not None else None
        constraint = self.compile(schema=schema, regex=regex, grammar=grammar)
        generator = torch.Generator(device=next(self.target.parameters()).device)
        generator.manual_seed(seed if seed is not None else torch.seed())
        room = min(max_new_tokens, self.context - len(prompt_ids))  # then "length"
        return _Prepared(sampling, prompt_ids, constraint, generator, room, schema is not None)

    def _pieces(self, rounds, constraint, stats, parse_json: bool, on_round) -> Iterator:
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a split character
        ids: list[int] = []
        # the lock is held while decoding runs: released when the iteration ends or is closed;
        # closing the pieces stops the decode loop too
        with self._lock, contextlib.closing(rounds):
            for r in rounds:
                if on_round is not None:
                    on_round(r)
                ids += r.committed
                piece = utf8.decode(self.vocab.output_bytes(r.committed))
                if piece:
                    yield piece
        if tail := utf8.decode(b"", final=True):  # only an incomplete character at "length"
            yield tail
        token_ids = [t for t in ids if t != self.vocab.eos_id]
        text = self.vocab.decode(token_ids)
        finish = finish_reason(ids, constraint)
        value = json.loads(text) if parse_json and finish == "stop" else None
        yield Result(text, value, token_ids, finish, stats)

    @_one_at_a_time
    def generate_batch(self, requests: Iterable[dict], batch_size: int = 8) -> list[Result]:
        """generate() over many requests, ``batch_size`` of them decoded together (one target
        forward per round for all of them), results in order. A request is a dict of
        generate()'s arguments (BATCH_ARGUMENTS; "prompt" required). Every request is checked
        before any model work: the first bad one raises. Drafts: grammar-forced tokens and
        prompt lookup per row (a draft head or model drafts one request at a time)."""
        from .batch import decode_batch

        rows = [self.prepare_row(i, request) for i, request in enumerate(requests)]
        results: list[Result] = [None] * len(rows)  # type: ignore[list-item]
        for row in decode_batch(self.target, rows, _batch_size(batch_size)):
            results[row.index] = self.row_result(row)
            row.cache = None  # its buffers serve a later row's cache (llama.CachePool)
        return results

    def batch(
        self, requests: Iterable[dict], batch_size: int = 8
    ) -> Iterator[tuple[int, Result | ValueError]]:
        """As generate_batch, for corpus jobs: yields (index, Result) as rows finish; a bad
        request yields (index, its error: one of the package's documented errors) and the
        others go on."""
        from .batch import decode_batch

        failed: list[tuple[int, ValueError]] = []

        def rows():
            for i, request in enumerate(requests):
                try:
                    yield self.prepare_row(i, request)
                except BAD_REQUEST_ERRORS as err:
                    failed.append((i, err))

        with self._lock:  # released when the iteration ends or is closed
            for row in decode_batch(self.target, rows(), _batch_size(batch_size)):
                yield from _drain(failed)
                yield row.index, self.row_result(row)
            yield from _drain(failed)

    def prepare_row(self, index: int, request: dict):
        """One request of a batch, checked and compiled: a batch.Row, for callers that run rounds
        themselves (batch.admit, then batch.batch_round until it is finished, then row_result;
        the server joins requests into a running batch this way)."""
        from .batch import Row, row_drafter

        if not isinstance(request, dict) or "prompt" not in request:
            raise GenerationInputError(
                f"request {index}: a batch request is a dict with at least a 'prompt'."
            )
        unknown = sorted(set(request) - set(BATCH_ARGUMENTS))
        if unknown:
            raise GenerationInputError(
                f"request {index}: unknown field(s) {', '.join(unknown)}; a batch request "
                f"takes {', '.join(BATCH_ARGUMENTS)}."
            )
        r = {**BATCH_DEFAULTS, **request}
        speculative = r.pop("speculative")
        p = self._prepare(**r)
        drafter = row_drafter(self.drafter) if speculative else None
        return Row(
            index,
            p.prompt_ids,
            p.constraint,
            p.sampling,
            p.generator,
            drafter,
            p.max_new_tokens,
            parse_json=p.parse_json,
        )

    def row_result(self, row) -> Result:
        """The Result of a finished batch.Row."""
        ids = row.tokens[len(row.prompt) :]
        token_ids = [t for t in ids if t != self.vocab.eos_id]
        text = self.vocab.decode(token_ids)
        finish = row.finish_reason
        value = json.loads(text) if row.parse_json and finish == "stop" else None
        return Result(text, value, token_ids, finish, row.stats)

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
            raise GenerationInputError(
                f"the prompt has {len(ids)} tokens but the model's context holds {self.context}: "
                "shorten the prompt."
            )
        return ids


# What a batch request may set (generate()'s arguments, less the per-call hooks), and defaults.
BATCH_DEFAULTS = {
    "schema": None,
    "regex": None,
    "grammar": None,
    "max_new_tokens": 256,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "seed": None,
    "speculative": True,
}
BATCH_ARGUMENTS = ("prompt", *BATCH_DEFAULTS)
BAD_REQUEST_ERRORS = (ConstraintError, GenerationInputError)


def _batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise GenerationInputError(f"batch_size={batch_size!r} must be an int >= 1.")
    return batch_size


def _drain(failed: list):
    while failed:
        yield failed.pop(0)


# Drafts that need no download. "auto" is what measured fastest on the default model on a 2-core
# CPU (docs/measurements.md): the trained head with forced tokens and prompt lookup, else lookup.
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
# (thresholds 0.1-0.7 measured within a few % of each other: docs/measurements.md).
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
    from .models import load_model, quantize_int8

    if draft in (None, "none"):
        return None
    if draft == "lookup":
        return CompositeDrafter(model=None, **_draft_limits(model))
    if draft == "int8":
        return quantize_int8(model)
    if draft == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16)
    return load_model(draft, dtype)[0]


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
            "protocol (constrained_spec.draft.Drafter): add them (no-ops where it "
            "has nothing to do)."
        )
    return drafter


# Below this temperature logits / T overflows float32 (the policy would see inf − inf = nan);
# such a temperature is greedy in all but name.
MIN_TEMPERATURE = 1e-4


def _check_sampling(temperature, top_k, top_p, num_draft_tokens, max_new_tokens) -> SamplingConfig:
    problems = []
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        problems.append(
            f"temperature={temperature} must be 0 (greedy) or a finite number >= "
            f"{MIN_TEMPERATURE:g} (lower ones are greedy in effect: pass 0)"
        )
    if top_k is not None and top_k < 1:
        problems.append(f"top_k={top_k} must be >= 1 or None")
    if top_p is not None and not 0 < top_p <= 1:
        problems.append(f"top_p={top_p} must be in (0, 1] or None")
    if num_draft_tokens < 0:
        problems.append(f"num_draft_tokens={num_draft_tokens} must be >= 0")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
    if problems:
        raise GenerationInputError("; ".join(problems) + ".")
    return SamplingConfig(temperature, top_k, top_p)


def _check_seed(seed) -> None:
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**64):
        raise GenerationInputError(f"seed={seed} must be an integer in [0, 2**64) or None.")


def _check_messages(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise GenerationInputError(
                f"chat message {i} is {str(m)[:80]}: each message needs a 'role' and a "
                "'content' string, e.g. {'role': 'user', 'content': 'Hi'}."
            )
