"""The ``constrained-spec`` command: constrained generation from the terminal.

Everything the user typed is validated before the model loads (that takes seconds); bad input
ends with one line on stderr and exit code 2. Output text goes to stdout, everything else
(live view, stats, errors) to stderr, so ``constrained-spec generate ... > out.json`` works:
the output finishes within --max-new-tokens (the budget mask); with --no-budget-mask, output cut
there is not the constraint's, so it exits 3 with stdout empty (``--partial`` prints the
incomplete text anyway). A --max-new-tokens below the constraint's shortest output is exit 2.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from .constraints import grammar_for, grammar_kind, grammar_names, load_grammar, load_schema
from .decoding import cost
from .decoding.head import shipped_head
from .errors import (
    BudgetTooSmall,
    ConstraintError,
    DraftHeadError,
    GenerationInputError,
    SettingError,
    VocabularyMismatch,
)
from .generator import DRAFTS, SETTINGS, Generator, Request, setting_problems
from .jobs import done_ids, read_rows, run_job, run_job_on_ray
from .model import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    WEIGHTS,
    ModelFetchError,
    cache_dir,
    disk,
    llama,
    load_model,
    machine,
    models,
    prepared,
)

__all__ = ["main", "build_parser"]

try:  # POSIX only: the --stats peak memory row says "-" without it
    import resource
except ImportError:
    resource = None

EXIT_FAILED = 1  # a batch job in which every row failed
EXIT_USAGE = 2
EXIT_INCOMPLETE = (
    3  # cut at --max-new-tokens (--no-budget-mask): the output is not the constraint's
)
# Errors that mean "the input is unusable", not "the program is wrong": one line, exit 2.
INPUT_ERRORS = (
    ConstraintError,
    GenerationInputError,
    VocabularyMismatch,
    DraftHeadError,
    SettingError,
)


class UsageError(Exception):
    """Bad command-line input, found before any model work."""


@dataclass(frozen=True)
class Invocation:
    """A validated ``generate`` invocation."""

    constraint: dict  # {"schema": dict}, {"regex": str} or {"grammar": str} (Lark/GBNF)
    prompt: str | list[dict]  # raw text, or chat messages (the chat template is applied)
    draft: str | None  # "int8", another model name/path, or None (baseline only)


# ---------------------------------------------------------------- argument parsing


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message; still exit code 2
        raise UsageError(f"{message} (see `{self.prog} --help`)")


LOOP_GUARD_HELP = (
    "no token that completes an immediate repeat of a stretch of 8 bytes or more (a small "
    "model's loops end sooner); it changes what the model would say, so it is off by default"
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="constrained-spec",
        description=(
            "Generate text that a JSON Schema, a regex or a named grammar accepts, with exact "
            "speculative decoding (the output is distributed exactly as plain masked sampling "
            "from the target model)."
        ),
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for add_command in (  # in the order `--help` lists them
        _add_generate_command,
        _add_batch_command,
        _add_grammars_command,
        _add_cache_command,
        _add_calibrate_command,
        _add_serve_command,
    ):
        add_command(commands)
    return parser


def _add_generate_command(commands) -> None:
    command = commands.add_parser(
        "generate",
        help="generate constrained text for a prompt",
        description="Print the generated text (JSON for a schema) on "
        "stdout; the live view, stats and errors go to stderr.",
    )
    _add_request_arguments(command)
    _add_model_arguments(command)
    _add_sampling_arguments(command)
    _add_speculation_arguments(command)
    command.set_defaults(run=_generate)


def _add_request_arguments(command: argparse.ArgumentParser) -> None:
    """What to generate, for what prompt."""
    command.add_argument(
        "prompt",
        metavar="PROMPT",
        help="the request, sent as one user chat message (see --raw-prompt)",
    )
    which = command.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--schema",
        metavar="FILE",
        help="JSON Schema file the output must satisfy (or inline JSON: an object; true: any JSON)",
    )
    which.add_argument(
        "--regex", metavar="RE", help="regex the whole output must match (no ^/$ needed)"
    )
    which.add_argument(
        "--grammar",
        metavar="NAME|FILE",
        help="a ready-made constraint shipped with the package (list: `constrained-spec "
        "grammars`), or a grammar file: .lark, .gbnf, .regex or .json (a schema)",
    )
    command.add_argument(
        "--open-objects",
        action="store_true",
        help="let objects that declare properties have undeclared ones too, where the schema "
        "says nothing about them (JSON Schema's meaning; by default they are closed, so that "
        "the model cannot invent keys)",
    )
    command.add_argument(
        "--raw-prompt",
        action="store_true",
        help="feed PROMPT to the model as is, without the chat template",
    )
    command.add_argument(
        "--system",
        metavar="TEXT",
        help="a system message placed before PROMPT (chat template only)",
    )


def _add_model_arguments(command: argparse.ArgumentParser) -> None:
    """Which model generates, drafted by what, with which weights."""
    command.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help=f"target model: a built-in name, a local path or a Hugging Face hub "
        f"id (default: {DEFAULT_MODEL})",
    )
    command.add_argument(
        "--draft",
        default="auto",
        metavar="DRAFT",
        help="drafter: "
        + "; ".join(f"'{k}' = {v}" for k, v in DRAFTS.items())
        + "; or a trained head's .safetensors file, or a draft model name/path "
        "sharing the target's tokenizer (default: auto)",
    )
    command.add_argument(
        "--weights",
        default="auto",
        choices=list(WEIGHTS),
        help="how the target runs: "
        + "; ".join(f"'{k}' = {v}" for k, v in WEIGHTS.items())
        + ". The baseline uses the same (default: auto)",
    )
    command.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target weights dtype for --weights float (default: float32)",
    )


def _add_sampling_arguments(command: argparse.ArgumentParser) -> None:
    """How to sample, and where to stop."""
    command.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sampling temperature, 0 = greedy (default: 0)",
    )
    command.add_argument(
        "--top-k",
        type=int,
        default=None,
        metavar="K",
        help="keep the K most likely legal tokens (default: off)",
    )
    command.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: keep the smallest set of legal tokens with mass P (default: off)",
    )
    command.add_argument(
        "--seed", type=int, default=None, help="random seed for sampling (default: random)"
    )
    command.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        metavar="N",
        help="the output finishes within N tokens (default: 256): the budget mask keeps only "
        "tokens after which it still can, so it is never cut (see --no-budget-mask)",
    )
    command.add_argument(
        "--no-budget-mask",
        action="store_true",
        help="let the output run to --max-new-tokens and be cut there: a cut output does not "
        "satisfy the constraint (exit code 3, stdout empty; see --partial)",
    )
    command.add_argument("--loop-guard", action="store_true", help=LOOP_GUARD_HELP)
    command.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the output before TEXT, where the constraint lets it end there "
        "(repeatable, up to 4)",
    )
    command.add_argument(
        "--partial",
        action="store_true",
        help="with exit code 3 (stopped at --max-new-tokens), still print the incomplete "
        "text on stdout",
    )


def _add_speculation_arguments(command: argparse.ArgumentParser) -> None:
    """How to speculate, and what to show."""
    command.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="tokens drafted per round, verified by one target call (default: 4)",
    )
    command.add_argument(
        "--adaptive-k",
        action="store_true",
        help="choose the model-drafted tokens per round (up to --num-draft-tokens) "
        "from the measured acceptance and draft cost",
    )
    command.add_argument(
        "--no-speculation",
        action="store_true",
        help="plain masked decoding, one target call per token (the baseline)",
    )
    command.add_argument(
        "--stats",
        action="store_true",
        help="print target calls, tokens per call, acceptance by draft position, "
        "TTFT, time per output token, total time and peak memory on stderr",
    )
    command.add_argument(
        "--show",
        action="store_true",
        help="live view on stderr: accepted drafts green, rejected draft struck "
        "through orange, the target's own token blue, forced tokens underlined",
    )


def _add_batch_command(commands) -> None:
    command = commands.add_parser(
        "batch",
        help="a corpus job: JSONL prompts in, JSONL results out (resumable)",
        description='Generate for every row of a JSONL file ({"id", "prompt" or '
        '"messages", optional "schema"}), several rows decoded together; each result '
        "line (id, text, value, finish_reason, stats, or error) is appended as its row "
        "finishes, and a rerun skips the ids already in --output.",
    )
    command.add_argument("--input", required=True, metavar="FILE", help="JSONL rows")
    command.add_argument("--output", required=True, metavar="FILE", help="JSONL results (appended)")
    which = command.add_mutually_exclusive_group()
    which.add_argument(
        "--schema", metavar="FILE", help="the rows' schema (a row may bring its own)"
    )
    which.add_argument("--regex", metavar="RE", help="a regex every output must match")
    which.add_argument(
        "--grammar", metavar="NAME", help="a shipped grammar (`grammars` lists them)"
    )
    command.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="rows decoded together (default: 8)"
    )
    command.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help=f"target model (default: {DEFAULT_MODEL})",
    )
    command.add_argument(
        "--weights",
        default="auto",
        choices=list(WEIGHTS),
        help="how the target runs (default: auto)",
    )
    command.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)"
    )
    command.add_argument("--top-k", type=int, default=None, metavar="K")
    command.add_argument("--top-p", type=float, default=None, metavar="P")
    command.add_argument(
        "--seed", type=int, default=None, help="row seeds: this plus the row's line number"
    )
    command.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    command.add_argument(
        "--no-budget-mask",
        action="store_true",
        help="let outputs be cut at --max-new-tokens (default: each finishes within it)",
    )
    command.add_argument("--loop-guard", action="store_true", help=LOOP_GUARD_HELP)
    command.add_argument(
        "--no-speculation", action="store_true", help="the batched masked baseline"
    )
    command.add_argument(
        "--raw-prompt", action="store_true", help='feed "prompt" as is, without the chat template'
    )
    _add_ray_arguments(command)
    command.set_defaults(run=_batch)


def _add_ray_arguments(command: argparse.ArgumentParser) -> None:
    """Where a batch job runs when not in this process."""
    command.add_argument(
        "--ray",
        action="store_true",
        help="run on Ray Data, one Generator per actor (pip install -e '.[ray]')",
    )
    command.add_argument(
        "--ray-actors", type=int, default=1, metavar="N", help="actors (default: 1)"
    )
    command.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="a running Ray cluster (default: start one on this machine)",
    )


def _add_grammars_command(commands) -> None:
    command = commands.add_parser(
        "grammars",
        help="list the ready-made grammars (--grammar NAME)",
        description="List the shipped grammars with a description.",
    )
    command.set_defaults(run=_list_grammars)


def _add_cache_command(commands) -> None:
    command = commands.add_parser(
        "cache",
        help="list what is cached (models, prepared models, kernels, measurements), or clear it",
        description="List the cache dir's entries with their size and last use; --clear "
        "removes all of them, or those named (each is rebuilt when next needed). Prepared "
        f"models take at most ${prepared.CAP_ENV} GB together (default "
        f"{prepared.DEFAULT_CAP_GB:g}); the least recently used go first.",
    )
    command.add_argument(
        "--clear",
        nargs="?",
        const=ALL,
        metavar="NAME",
        help="remove every entry, or the one named (or a kind: models, prepared, kernels, "
        "measurements)",
    )
    command.set_defaults(run=_cache)


def _add_calibrate_command(commands) -> None:
    command = commands.add_parser(
        "calibrate",
        help="measure this machine's pass costs again for a model, and say what runs",
        description="Name the kernels a load runs (fixed by this CPU's features: the 4-bit "
        "matmul, how the layers run, the prompts' kernel, the LM head), measure the pass-cost "
        "table that speculation plans with again, store it in the cache and print it. Run it on "
        "a quiet machine: a measurement taken while other processes kept the CPUs busy is used "
        "once and not kept.",
    )
    command.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help=f"a built-in name or a .gguf file (default: {DEFAULT_MODEL})",
    )
    command.set_defaults(run=_calibrate)


def _add_serve_command(commands) -> None:
    command = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (needs the [serve] extra)",
        description="Serve POST /v1/chat/completions (response_format, tools, regex/grammar "
        "extensions, streaming), GET /v1/models and GET /health. Up to --batch-size "
        "requests decode together; the rest wait in arrival order (docs/server.md).",
    )
    command.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME", help="as for generate")
    command.add_argument("--draft", default="auto", metavar="DRAFT", help="as for generate")
    command.add_argument("--weights", default="auto", choices=list(WEIGHTS), help="as for generate")
    command.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: local)"
    )
    command.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    command.add_argument(
        "--open-objects", action="store_true", help="as for generate: undeclared properties"
    )
    command.add_argument(
        "--api-key",
        default=os.environ.get("CONSTRAINED_SPEC_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (default: $CONSTRAINED_SPEC_API_KEY, "
        "else no key)",
    )
    for flag, default, what in (
        ("--max-queue", 64, "requests waiting or running; more get 429"),
        ("--max-tokens", 4096, "the most tokens a request may ask for; more get 400"),
        ("--max-body-bytes", 1 << 20, "request body size limit; larger get 413"),
        ("--max-schema-bytes", 64 << 10, "schema / regex size limit; larger get 400"),
        (
            "--batch-size",
            16,
            "requests decoded together, one target forward per round for all (1: one at a "
            "time, with any drafter; more: grammar-forced and lookup drafts per request)",
        ),
        (
            "--threads",
            None,
            "torch threads for decoding (default: torch's, one per core; "
            "on a busy CPU 1 can be much faster)",
        ),
    ):
        command.add_argument(
            flag, type=int, default=default, metavar="N", help=f"{what} (default: {default})"
        )
    command.set_defaults(run=_serve)


def _batch(args, out: Console, err: Console) -> int:
    """The corpus job: everything checked before the model loads, then rows stream to --output."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be >= 1.")
    Request(
        "", temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens,
    ).sampling()  # fmt: skip
    constraint = _constraint(args) if (args.schema or args.regex or args.grammar) else None
    rows = read_rows(Path(args.input))
    if constraint is None and (bare := next((r for r in rows if r.schema is None), None)):
        raise UsageError(
            f'{args.input}:{bare.line} has no "schema" and the job has none: pass '
            "--schema, --regex or --grammar."
        )
    output = Path(args.output)
    done = len(done_ids(output) & {row.id for row in rows})  # a corrupt output stops it here
    _check_model_name(args.model, "--model")
    make_generator = functools.partial(
        Generator.from_pretrained,
        args.model,
        draft="none" if args.no_speculation else "lookup",
        weights=args.weights,
    )
    err.print(f"{len(rows)} rows, {done} already in {output}; loading {args.model} ...")
    if args.ray:
        run = _on_ray(args, make_generator)
    else:
        gen = make_generator()

        def run(*job):
            return run_job(gen, *job)

    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        budget_mask=not args.no_budget_mask,
        loop_guard=args.loop_guard,
        raw_prompt=args.raw_prompt,
    )
    columns = (
        TextColumn("rows"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("", total=len(rows) - done)

        def progress(finished, total, tokens, seconds):
            rate = f"{finished / seconds:.2f} rows/s, {tokens / seconds:.1f} tok/s"
            bar.update(task, completed=finished, description=rate)

        summary = run(rows, constraint or {}, output, options, args.batch_size, progress)
    _print_summary(summary, output, err)
    return EXIT_FAILED if summary.all_failed else 0


# The failed rows a job's summary names; the rest are counted (every one has its output line).
SHOWN_FAILURES = 10


def _print_summary(summary, output: Path, err: Console) -> None:
    counts = summary.counts
    err.print(
        f"done: {counts['stopped']} stopped, {counts['length']} cut at --max-new-tokens, "
        f"{counts['refused']} refused schemas, {counts['error']} bad rows, "
        f"{counts['skipped']} already done → {output}"
    )
    for row_id, error in summary.failures[:SHOWN_FAILURES]:
        err.print(Text.assemble(("failed ", "red"), f"{row_id!r}: {error}"), soft_wrap=True)
    if len(summary.failures) > SHOWN_FAILURES:
        more = len(summary.failures) - SHOWN_FAILURES
        err.print(f"... and {more} more failed rows: their lines in {output} say why")
    if summary.all_failed:
        err.print(Text.assemble(("error: ", "bold red"), f"every row failed (exit {EXIT_FAILED})"))


def _on_ray(args, make_generator):
    """The job's runner on Ray: a local Ray instance, or the cluster at --ray-address."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install -e '.[ray]'.") from None
    if args.ray_actors < 1:
        raise UsageError(f"--ray-actors {args.ray_actors} must be >= 1.")
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)

    def run(*job):
        return run_job_on_ray(make_generator, *job[:-1], actors=args.ray_actors, progress=job[-1])

    return run


def _constraint(args) -> dict:
    """The constraint of --schema / --regex / --grammar, checked: refusals and syntax errors
    now, before the model loads."""
    if args.grammar is not None:
        constraint = load_grammar(args.grammar)
    elif args.schema is not None:
        constraint = {"schema": load_schema(args.schema)}
    else:
        constraint = {"regex": args.regex}
    grammar_for("", getattr(args, "open_objects", False), **constraint)
    return constraint


def _validate(args) -> Invocation:
    """Everything that can be checked without the model; raises UsageError / ConstraintError."""
    settings = {f: v for f, v in vars(args).items() if f in SETTINGS}  # those it has flags for
    problems = setting_problems(settings, lambda field: f"--{field.replace('_', '-')} ")
    if not args.prompt.strip():
        problems.append("PROMPT is empty: give the model something to respond to")
    if args.system is not None and args.raw_prompt:
        problems.append("--system needs the chat template: drop --raw-prompt")
    if problems:
        raise UsageError("; ".join(problems) + ".")
    constraint = _constraint(args)
    _check_model_name(args.model, "--model")
    draft = None if args.draft.lower() == "none" or args.no_speculation else args.draft
    if draft not in (None, *DRAFTS):
        _check_model_name(draft, "--draft")
    if draft == "head":
        shipped_head(args.model)  # raises DraftHeadError naming the heads there are
    if args.dtype != "float32" and args.weights in ("int4", "int8"):
        raise UsageError(
            f"--weights {args.weights} fixes its own numerics: drop --dtype "
            f"{args.dtype}, or pass --weights float."
        )
    if draft in ("int8", "bf16") and args.weights in ("int4", "int8"):
        raise UsageError(
            f"--draft {draft} copies a float target: pass --weights float, or "
            "--draft head or lookup."
        )
    if draft == "int8" and args.dtype != "float32":
        raise UsageError(
            f"--draft int8 quantizes a float32 target: drop --dtype {args.dtype}, "
            "or pass --draft none or a draft model."
        )
    if args.raw_prompt:
        prompt = args.prompt
    else:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    return Invocation(constraint, prompt, draft)


def _check_model_name(name: str, flag: str) -> None:
    """A built-in name, an existing local path, or something shaped like a hub id (owner/name)."""
    builtin = set(BUILTIN_MODELS)
    if name in builtin or Path(name).expanduser().exists():
        return
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.startswith((".", "/")):
        return  # a hub id: only the load can tell whether it exists
    raise UsageError(
        f"{flag} {name!r} is not a built-in model, a local path or a hub id "
        f"(owner/name): built-in models are {', '.join(sorted(builtin))}."
    )


# ---------------------------------------------------------------- commands


def _list_grammars(args, out: Console, err: Console) -> int:
    names = grammar_names()
    table = Table("name", "kind", "description", box=None, pad_edge=False)
    for name, description in names.items():
        kind = {"json": "schema"}.get(grammar_kind(name), grammar_kind(name))
        table.add_row(name, kind, description)
    out.print(table)
    return 0


ALL = object()  # `cache --clear` without a name


def _cache(args, out: Console, err: Console) -> int:
    cap = prepared.cap_bytes()  # a bad setting: exit 2, naming it
    if args.clear is not None:
        try:
            chosen = disk.matching(None if args.clear is ALL else args.clear)
        except ValueError as e:
            raise UsageError(str(e)) from None
        disk.remove(chosen)
        for entry in chosen:
            out.print(f"removed {entry.name} ({_size(entry.size)})", soft_wrap=True)
        freed = sum(e.size for e in chosen)
        out.print(f"{len(chosen)} entries, {_size(freed)} freed from {cache_dir()}", soft_wrap=True)
        return 0
    found = disk.entries()
    total = sum(e.size for e in found)
    in_prepared = sum(e.size for e in found if e.kind == "prepared")
    out.print(
        f"{cache_dir()}: {_size(total)}; prepared models {_size(in_prepared)} of "
        f"{cap / 1e9:g} GB (${prepared.CAP_ENV})",
        soft_wrap=True,
    )
    rows = [("name", "kind", "size", "last use", "what")]
    for e in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_use)) if e.last_use else "-"
        rows.append((e.name, e.kind, _size(e.size), when, e.about))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows if found else [("(empty)",)]:  # whole names, whatever the width: --clear
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
        out.print(line if found else row[0], soft_wrap=True, markup=False, highlight=False)
    return 0


def _calibrate(args, out: Console, err: Console) -> int:
    model_path = Path(args.model).expanduser()
    if args.model not in BUILTIN_MODELS and not (
        model_path.suffix == ".gguf" and model_path.is_file()
    ):
        raise UsageError(
            f"--model {args.model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
            "nor a .gguf file that exists: give one of those."
        )
    machine.measure_again()
    t0 = time.perf_counter()
    try:
        model, _ = load_model(args.model, weights="auto")
    except ModelFetchError as e:
        err.print(Text.assemble(("error: ", "bold red"), str(e)))
        return 1
    except (OSError, ValueError) as e:  # a file the loader cannot read: its error
        raise UsageError(f"cannot load model {args.model!r}: {_first_line(e)}") from None
    for line in _calibration_lines(args.model, model, t0):
        out.print(line, soft_wrap=True, markup=False, highlight=False)
    return 0


def _calibration_lines(name: str, model, t0: float) -> list[str]:
    """What ``constrained-spec calibrate`` prints: what the load runs and why, then the
    pass-cost table measured again, one line each."""
    lines = [
        f"model: {name} ({models.shape_key(model.config)}), weights "
        f"{getattr(model, 'weights', 'float')} ({models.auto_weights(name)[1]})",
    ]
    if not isinstance(model, llama.CompactLlama):
        return [*lines, "transformers' forward runs it: no kernel or pass-cost choices"]
    lines.append(
        f"kernels (this CPU's features; no timing decides them): 4-bit matmuls {model.matmul}, "
        f"layers {model.layer_kernel}, prompts {model.prefill}, LM head "
        f"{type(model.lm_head).__name__}"
    )
    table = cost.pass_cost(model, cost.GRID_ROWS[-1])  # the whole grid
    for rows, points in table.grid.items():
        fed = ", ".join(f"{n} fed {t:.1f}" for n, t in points)
        lines.append(f"pass cost, {rows} row{'s' * (rows > 1)} (ms): {fed}")
    lines.append(
        f"acceptance rule per position: sampled {table.sampled_ms:.3f} ms, "
        f"greedy {table.greedy_ms:.3f} ms"
    )
    done = machine.measured_now()
    loaded = [k for k, v in done.items() if machine.PROVISIONAL in v]
    lines.append(
        f"{len(done)} measurements in {time.perf_counter() - t0:.0f} s, "
        + (
            f"{len(loaded)} under load: used once, not kept (run calibrate on a quiet machine)"
            if loaded
            else f"all on a quiet machine: kept in {cache_dir() / 'calibration.json'}"
        )
    )
    return lines


def _size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _generate(args, out: Console, err: Console) -> int:
    request = _validate(args)  # before the model: loading it takes seconds
    t0 = time.perf_counter()
    try:  # no spinner here: the first load shows its own download / conversion progress
        gen = _load_generator(args, request.draft)
    except ModelFetchError as e:  # not the user's input: no network, corrupt download
        err.print(Text.assemble(("error: ", "bold red"), str(e)))
        return 1
    load_s = time.perf_counter() - t0
    prompt = _prompt_for(gen, request.prompt, args, err)
    try:
        result, meter, wall_s = _decode(gen, prompt, request.constraint, args, err)
    except BudgetTooSmall as e:  # checked before any model work, in the CLI's terms
        raise UsageError(
            f"--max-new-tokens {e.given} is below the {e.shortest} tokens of the shortest output "
            f"found for this constraint ({e.text!r}, then the end): raise it to {e.shortest} at "
            "least, or pass --no-budget-mask to have the output cut."
        ) from None
    incomplete = result.finish_reason == "length"
    _print_output(result.text, incomplete, args, err)
    if args.stats:
        weights = getattr(gen, "weights_choice", gen.weights)
        err.print(stats_table(result, meter, load_s, wall_s, args, request, weights))
    return EXIT_INCOMPLETE if incomplete else 0


def _load_generator(args, draft: str | None) -> Generator:
    """The generator --model, --weights and --dtype ask for; a load that the names given
    break (unknown name, missing path or hub id, bad files) is a UsageError."""
    try:
        return Generator.from_pretrained(
            args.model,
            draft=draft,
            weights=args.weights,
            dtype=getattr(torch, args.dtype),
            open_objects=args.open_objects,
        )
    except (OSError, ValueError) as e:
        message = _first_line(e)
        raise UsageError(
            message if args.model in message else f"cannot load model {args.model!r}: {message}"
        ) from None


def _prompt_for(gen: Generator, prompt: str | list[dict], args, err: Console) -> str | list[dict]:
    """The prompt as this model takes it: chat messages go in as plain text to a base model
    (one without a chat template), which cannot take a --system message."""
    if isinstance(prompt, str) or gen.tokenizer.chat_template:
        return prompt
    if args.system is not None:
        raise UsageError(
            f"--system needs a chat template, and {args.model} has none (a base model): "
            "drop --system and put the instructions in PROMPT."
        )
    err.print(
        f"note: {args.model} has no chat template (a base model): PROMPT goes in as plain "
        "text, as with --raw-prompt.",
        style="yellow",
        markup=False,
        soft_wrap=True,
    )
    return args.prompt


def _decode(gen: Generator, prompt, constraint: dict, args, err: Console):
    """Generate with the decoding flags, the live view on stderr under --show; the result,
    its meter and the seconds it took (the view's closing not counted)."""
    meter, t0 = _Meter(), time.perf_counter()
    view = RoundView(gen, gen.compile(**constraint), err) if args.show else None
    try:
        result = gen.generate(
            prompt,
            **constraint,
            max_new_tokens=args.max_new_tokens,
            budget_mask=not args.no_budget_mask,
            loop_guard=args.loop_guard,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_draft_tokens=args.num_draft_tokens,
            speculative=not args.no_speculation,
            seed=args.seed,
            adaptive_k=args.adaptive_k,
            stop=args.stop,
            on_round=meter.chain(view),
        )
    finally:
        wall_s = time.perf_counter() - t0
        if view is not None:
            view.close()
    return result, meter, wall_s


def _print_output(text: str, incomplete: bool, args, err: Console) -> None:
    """The text on stdout, unless it was cut at --max-new-tokens (then only with --partial),
    and why it was cut on stderr."""
    if not incomplete or args.partial:
        sys.stdout.write(text + "\n")  # exactly the text: no markup, emoji or wrapping
        sys.stdout.flush()
    if incomplete:  # one line, whatever the terminal width
        shown = "it is on stdout" if args.partial else "--partial prints it"
        err.print(
            f"error: stopped at --max-new-tokens {args.max_new_tokens} before the output was "
            f"complete (exit {EXIT_INCOMPLETE}): raise --max-new-tokens; the text is "
            f"incomplete ({shown}).",
            style="yellow",
            markup=False,
            soft_wrap=True,
        )


def _serve(args, out: Console, err: Console) -> int:
    _check_model_name(args.model, "--model")
    if (
        not 0 < args.port < 65536
        or min(args.max_queue, args.max_tokens, args.batch_size, args.threads or 1) < 1
        or args.threads == 0
    ):
        raise UsageError(
            "--port must be in 1..65535; --max-queue, --max-tokens, --batch-size and --threads >= 1."
        )
    try:
        from .server import ServerConfig, serve
    except ImportError as e:
        raise UsageError(
            f"the server needs its extra ({e.name} is missing): pip install "
            "'constrained_spec[serve]'."
        ) from None
    config = ServerConfig(
        model=args.model,
        draft=args.draft,
        weights=args.weights,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_schema_bytes=args.max_schema_bytes,
        max_tokens=args.max_tokens,
        max_queue=args.max_queue,
        threads=args.threads,
        batch_size=args.batch_size,
        open_objects=args.open_objects,
    )
    err.print(f"serving {args.model} on http://{args.host}:{args.port}/v1 (loading the model)")
    serve(config, args.host, args.port)
    return 0


# ---------------------------------------------------------------- live view and stats


class _Meter:
    """Counts committed tokens per round (EOS included), for tokens-per-call and TPOT."""

    def __init__(self):
        self.committed, self.first_round = 0, 0

    def chain(self, then):
        def on_round(r):
            self.committed += len(r.committed)
            if not self.first_round:
                self.first_round = len(r.committed)
            if then is not None:
                then(r)

        return on_round


class RoundView:
    """The live terminal view, fed one ``Round`` at a time by ``generate(on_round=...)``."""

    def __init__(self, gen, constraint, console: Console):
        self.gen, self.constraint = gen, constraint
        self.state = constraint.initial_state
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = Text()
        self.calls = self.tokens = self.forced = self.drafted = self.accepted = 0
        self.console, self.live = console, None

    def __call__(self, r) -> None:
        self.text.append_text(render_round(r, self._piece, self._step))
        self.calls += 1
        self.tokens += len(r.committed)
        self.drafted += len(r.drafted)
        self.accepted += r.accepted
        if self.live is not None:
            self.live.update(self._render())
        elif self.console.is_terminal:  # started on the first round: errors before it stay clean
            self.live = Live(
                self._render(),
                console=self.console,
                refresh_per_second=10,
                vertical_overflow="visible",
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.live.start()

    def close(self) -> None:
        """End the view; on a non-terminal (a pipe, a file) print it once, complete."""
        if self.live is not None:
            self.live.stop()
        elif self.calls:
            self.console.print(self._render())

    def _piece(self, token: int, committed: bool) -> str:
        if token == self.constraint.eos_id:
            return "⏎"
        if not committed:  # a rejected draft token: shown alone, never fed to the text
            return self.gen.vocab.decode([token])
        return self.utf8.decode(self.gen.vocab.token_bytes[token] or b"")

    def _step(self, token: int) -> bool:
        """Advance the automaton over a committed token; True iff it was forced."""
        forced = self.constraint.forced(self.state) == token
        self.state = self.constraint.step(self.state, token)
        self.forced += forced
        return forced

    def _render(self):
        per_call = self.tokens / self.calls if self.calls else 0.0
        counter = Text.assemble(
            ("target calls ", "bold"),
            str(self.calls),
            ("  vs  tokens ", "bold"),
            str(self.tokens),
            f"  ({per_call:.2f} tokens/call; drafts accepted {self.accepted}/{self.drafted}, "
            f"forced {self.forced})",
            style="dim",
        )
        legend = Text.assemble(
            ("accepted draft", "green"),
            "  ",
            ("rejected draft", STRUCK),
            "  ",
            ("target token", "blue"),
            "  ",
            ("forced", "underline"),
            style="dim",
        )
        return Group(self.text, counter, legend)


STRUCK = "strike dark_orange"


def render_round(r, piece, step) -> Text:
    """One round as styled text: accepted draft tokens green, the first rejected draft token
    struck through in orange, then the target's correction or bonus token in blue; tokens the
    constraint forced (exactly one legal token) underlined. ``piece(token, committed)`` gives a
    token's text, ``step(token)`` advances the automaton and says whether the token was forced."""
    out = Text()
    for i, token in enumerate(r.committed):
        if i == r.accepted and r.accepted < len(r.drafted):
            out.append(piece(r.drafted[r.accepted], False), style=STRUCK)
        style = "green" if i < r.accepted else "blue"
        if step(token):
            style += " underline"
        out.append(piece(token, True), style=style)
    return out


def stats_table(
    result, meter: _Meter, load_s: float, wall_s: float, args, request, weights: str = ""
) -> Table:
    s = result.stats
    n = meter.committed  # generated tokens, EOS included (the baseline makes one call per token)
    tpot = (s.total_s - s.ttft_s) / (n - meter.first_round) if n > meter.first_round else 0.0
    by_position = "  ".join(
        f"{i + 1}: {a / d:.0%}"
        for i, (a, d) in enumerate(zip(s.accepted_by_position, s.drafted_by_position))
        if d
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if resource is not None else None
    peak_mb = peak / 2**20 if sys.platform == "darwin" else (peak or 0) / 2**10  # bytes vs KiB
    table = Table(
        title="generation stats", show_header=False, box=None, pad_edge=False, title_justify="left"
    )
    table.add_column(style="bold")
    table.add_column()
    rows = [
        (
            "model / draft",
            f"{args.model} / "
            f"{'none (baseline)' if request.draft is None or args.no_speculation else request.draft}",
        ),
        ("target weights", weights),
        ("finish", f"{result.finish_reason}, {n} tokens{_budget_note(result)}"),
        (
            "target calls",
            f"{s.target_calls} ({n / s.target_calls if s.target_calls else 0:.2f} tokens per call)",
        ),
        ("drafts accepted", f"{s.accepted}/{s.drafted} ({s.acceptance_rate:.0%})"),
        ("acceptance by position", by_position or "-"),
        ("TTFT", f"{s.ttft_s * 1e3:.0f} ms (prefill {s.prefill_s * 1e3:.0f} ms)"),
        ("time per output token", f"{tpot * 1e3:.1f} ms"),
        (
            "total",
            f"{s.total_s:.2f} s ({n / s.total_s if s.total_s else 0:.1f} tok/s; draft "
            f"{s.draft_s:.2f} s, verify {s.verify_s:.2f} s; with compile {wall_s:.2f} s)",
        ),
        ("model load", f"{load_s:.1f} s"),
        ("peak memory (RSS)", f"{peak_mb:.0f} MiB" if peak is not None else "-"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


# ---------------------------------------------------------------- entry point


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _budget_note(result) -> str:
    removed = result.stats.budget_removed
    return f" (the budget mask removed the token drawn at {removed} of them)" if removed else ""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failed, 2 bad input, 3 stopped at
    --max-new-tokens before the output was complete, 130 interrupted)."""
    out, err = Console(), Console(stderr=True)
    try:
        args = build_parser().parse_args(argv)
        return args.run(args, out, err)
    except (UsageError, *INPUT_ERRORS) as e:
        err.print(Text.assemble(("error: ", "bold red"), _first_line(e)), soft_wrap=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


# Commands that hold nothing to clean up when they end (no server, no worker processes).
ONE_SHOT = ("generate", "grammars", "cache", "calibrate")


def run() -> None:
    """The ``constrained-spec`` command: ``main`` with the process's arguments, then its exit.
    A one-shot command leaves at once once its output is flushed: the interpreter's teardown
    of torch (its modules' finalizers) costs 0.27 s here, a fifth of a warm call
    (benchmarks/startup.py)."""
    code = main()
    if len(sys.argv) > 1 and sys.argv[1] in ONE_SHOT:
        prepared.wait()  # a model prepared by this call: stored for the next
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
