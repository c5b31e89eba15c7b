"""Corpus jobs: a JSONL file of prompts in, one JSONL result line per row out, resumable.

Input lines: ``{"id": ..., "prompt": "..."}`` (sent as one user chat message, as `generate` does)
or ``{"id": ..., "messages": [...]}``, optionally with their own ``"schema"`` (else the job's). The whole input is checked before the model loads; a bad
row (an unsupported schema, an empty or too long prompt) gets its error in its own result line
and the others go on. Results are appended as rows finish, each line written whole and flushed,
so a crash or Ctrl-C loses at most the rows in flight; a rerun skips the ids already written.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConstraintError, GenerationInputError

__all__ = [
    "JobInputError",
    "Row",
    "Summary",
    "done_ids",
    "read_rows",
    "run_job",
    "run_job_on_ray",
]


class JobInputError(GenerationInputError):
    """The input (or output) file of a batch job is unusable as a whole: names file and line."""


@dataclass(frozen=True)
class Row:
    id: object  # the input's id (a str or an int), echoed in its result line
    line: int  # 1-based line number in the input
    prompt: object  # text, or chat messages
    schema: dict | None  # the row's own schema, else None (the job's constraint)


@dataclass
class Summary:
    """How a job's rows ended: counts by kind (stopped, length, refused, error, skipped) and the
    rows that failed, (id, error), in the order their lines were written."""

    counts: Counter = field(default_factory=Counter)
    failures: list[tuple[object, str]] = field(default_factory=list)

    @property
    def all_failed(self) -> bool:
        """Whether rows ran and none of them produced text (a job that did nothing)."""
        ran = sum(self.counts.values()) - self.counts["skipped"]
        return ran > 0 and len(self.failures) == ran


def read_rows(path: Path) -> list[Row]:
    """Every row of the input, checked: JSON objects with a unique id and a prompt or messages."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise JobInputError(f"cannot read the input {path}: {err}.") from None
    rows, seen = [], set()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(text)
        except json.JSONDecodeError as err:
            raise JobInputError(f"{where}: not JSON ({err.msg}, column {err.colno}).") from None
        if not isinstance(item, dict) or "id" not in item:
            raise JobInputError(f'{where}: a row is a JSON object with an "id".')
        if not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool):
            raise JobInputError(f"{where}: the id must be a string or an integer.")
        if item["id"] in seen:
            raise JobInputError(f"{where}: the id {item['id']!r} appears twice.")
        seen.add(item["id"])
        unknown = sorted(set(item) - {"id", "prompt", "messages", "schema"})
        if unknown or ("prompt" in item) == ("messages" in item):
            raise JobInputError(
                f'{where}: a row has an id, exactly one of "prompt" / "messages", and '
                f'optionally a "schema"'
                + (f" (unknown: {', '.join(unknown)})." if unknown else ".")
            )
        rows.append(
            Row(item["id"], number, item.get("prompt", item.get("messages")), item.get("schema"))
        )
    if not rows:
        raise JobInputError(f"the input {path} has no rows: one JSON object per line.")
    return rows


def done_ids(path: Path) -> set:
    """The ids already written to ``path``; a last line cut short by a crash is removed."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as f:  # the partial line of a row in flight: it is rerun
            f.truncate(len(whole))
    ids = set()
    for number, text in enumerate(whole.decode("utf-8").splitlines(), 1):
        try:
            ids.add(json.loads(text)["id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise JobInputError(
                f"{path}:{number} is not a result line of this tool: pass another --output, "
                "or remove the file to start over."
            ) from None
    return ids


def run_job(
    gen,
    rows: list[Row],
    constraint: dict,
    output: Path,
    options: dict,
    batch_size: int,
    progress=None,
) -> Summary:
    """Decode the rows not yet in ``output``; append a result line per row as it finishes.
    ``constraint``: the job's {"schema": ...} or {"regex": ...}; ``options``: generate()
    arguments for every row (a ``seed`` is offset by the row's line number)."""
    todo, summary = _pending(rows, output)
    requests = [_request(row, constraint, options) for row in todo]
    finished = ((i, _result_fields(result)) for i, result in gen.batch(requests, batch_size))
    return _append(output, todo, finished, summary, progress)


def run_job_on_ray(
    make_generator,
    rows: list[Row],
    constraint: dict,
    output: Path,
    options: dict,
    batch_size: int,
    actors: int = 1,
    progress=None,
) -> Summary:
    """run_job on Ray Data, for corpora that outgrow one machine: the pending rows become a
    dataset mapped in blocks by ``actors`` actors, each with its own Generator
    (``make_generator()``, called once per actor); result lines are appended by this process
    as blocks come back, so resuming works as in run_job."""
    import ray

    todo, summary = _pending(rows, output)
    if not todo:
        return summary
    items = [
        {"index": i, "request": json.dumps(_request(row, constraint, options))}
        for i, row in enumerate(todo)
    ]
    dataset = ray.data.from_items(items).map_batches(
        _RayWorker,
        fn_constructor_args=(make_generator, batch_size),
        batch_size=2 * batch_size,  # a block keeps the actor's batch full, with refills
        concurrency=actors,
    )
    finished = ((int(item["index"]), json.loads(item["result"])) for item in dataset.iter_rows())
    return _append(output, todo, finished, summary, progress)


def _pending(rows: list[Row], output: Path) -> tuple[list[Row], Summary]:
    """The rows whose ids ``output`` does not hold yet, and a summary with those skipped."""
    done = done_ids(output)
    todo = [row for row in rows if row.id not in done]
    return todo, Summary(Counter(skipped=len(rows) - len(todo)))


def _append(output: Path, todo: list[Row], finished, summary: Summary, progress) -> Summary:
    """Append one whole, flushed line per finished (index into ``todo``, result fields)."""
    counts = summary.counts
    start, tokens = time.perf_counter(), 0
    with open(output, "a", encoding="utf-8") as out:
        for index, fields in finished:
            line, kind = _line_of(todo[index], fields)
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
            counts[kind] += 1
            if "error" in line:
                summary.failures.append((line["id"], line["error"]))
            tokens += line.get("stats", {}).get("tokens", 0)
            if progress is not None:
                done = sum(counts.values()) - counts["skipped"]
                progress(done, len(todo), tokens, time.perf_counter() - start)
        os.fsync(out.fileno())
    return summary


class _RayWorker:
    """One Ray actor: a Generator, decoding a block of requests as one continuous batch."""

    def __init__(self, make_generator, batch_size: int):
        self.gen, self.batch_size = make_generator(), batch_size

    def __call__(self, block: dict) -> dict:
        requests = [json.loads(text) for text in block["request"]]
        results = [""] * len(requests)
        for i, result in self.gen.batch(requests, self.batch_size):
            results[i] = json.dumps(_result_fields(result), ensure_ascii=False)
        return {"index": block["index"], "result": results}


def _request(row: Row, constraint: dict, options: dict) -> dict:
    """The Generator request (Request's fields) of a row; options["raw_prompt"]: a "prompt" is
    fed as is, not as a user chat message."""
    options = dict(options)
    raw = options.pop("raw_prompt", False)
    chat = isinstance(row.prompt, str) and not raw
    request = {
        **options,
        "prompt": [{"role": "user", "content": row.prompt}] if chat else row.prompt,
    }
    if row.schema is not None:
        request["schema"] = row.schema
    else:
        request.update(constraint)
    if options.get("seed") is not None:
        request["seed"] = options["seed"] + row.line
    return request


def _result_fields(result) -> dict:
    """A Result or a row's error as the JSON fields of its line (the id aside)."""
    if isinstance(result, Exception):
        kind = "refused" if isinstance(result, ConstraintError) else "error"
        return {"error": str(result).splitlines()[0], "kind": kind}
    stats = result.stats
    return {
        "text": result.text,
        "value": result.value,
        "finish_reason": result.finish_reason,
        "stats": {
            "tokens": len(result.token_ids),
            "target_calls": stats.target_calls,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "cached_prompt_tokens": stats.cached_prompt_tokens,
            "budget_removed": stats.budget_removed,
            "latency_s": round(stats.total_s, 4),
        },
    }


def _line_of(row: Row, fields: dict) -> tuple[dict, str]:
    if "error" in fields:
        return {"id": row.id, "error": fields["error"]}, fields["kind"]
    kind = "length" if fields["finish_reason"] == "length" else "stopped"  # or "budget"
    return {"id": row.id, **fields}, kind
