"""Benchmark requests from JSONSchemaBench (development half), and the tiny model of ``--quick``.

A fixed, seeded selection of schemas that the compiler accepts and compiles quickly, each with a
short valid instance (valid under jsonschema with its format checker, and accepted by our
automaton so the extraction answer is reachable). Two workloads over the same selection:
    extract   the prompt gives the schema and the instance as plain ``field: value`` lines;
              the answer is that instance as JSON (values are copied from the prompt)
    generate  the prompt gives only the schema and asks for a realistic example
Refusals (unsupported keyword, too complex, no short valid instance, ...) are counted by reason.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import jsonschema

from constrained_spec import ConstraintError, testing

# The default: 48 dev-set files committed with the benchmarks (benchmarks/data/sample/README.md).
DATA = Path(__file__).resolve().parent / "data" / "sample"
# The full dev set (5,197 files; pass it with --data), where this project's machines keep it.
DEV_SET = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench-dev"
WORKLOADS = ("extract", "generate")


@dataclass(frozen=True)
class Selection:
    seed: int = 0  # shuffles the file list: the same seed gives the same requests
    max_schema_chars: int = 1500  # compact schema text, so prompts fit the model's context
    min_instance_chars: int = 20  # a few tokens only would measure per-request overhead
    max_instance_chars: int = 300  # compact JSON of the expected instance
    max_prompt_tokens: int = 1024


@dataclass(frozen=True)
class Request:
    id: str  # "<workload>-<index>"
    file: str  # dataset file name
    source: str  # dataset subset (Github_easy, Kubernetes, ...)
    workload: str
    schema: dict
    messages: list | str  # chat messages (one user turn); plain text for a base model
    expected: object = None  # the instance stated in an extract prompt
    prompt_tokens: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def source_of(name: str) -> str:
    return name.split("---")[0] if "---" in name else name.rsplit("_", 1)[0]


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def is_valid(schema: dict, value) -> bool:
    try:
        return validator(schema).is_valid(value)
    except Exception:  # a schema jsonschema cannot use (bad $ref, ...) validates nothing
        return False


def field_lines(value, prefix: str = "") -> list[str]:
    """An instance as plain ``field: value`` lines (dotted paths, [i] for array items)."""
    if isinstance(value, dict) and value:
        return [
            line
            for k, v in value.items()
            for line in field_lines(v, f"{prefix}.{k}" if prefix else str(k))
        ]
    if isinstance(value, list) and value:
        return [line for i, v in enumerate(value) for line in field_lines(v, f"{prefix}[{i}]")]
    text = value if isinstance(value, str) and "\n" not in value else compact(value)
    return [f"{prefix or 'value'}: {text}"]


def as_prompt(tokenizer, messages: list[dict] | str) -> list[dict] | str:
    """The messages as the model takes them: through its chat template where it has one, else
    their contents as plain text (a base model, such as Gemma 3 270M's file)."""
    if isinstance(messages, str) or getattr(tokenizer, "chat_template", None):
        return messages
    return "\n\n".join(m["content"] for m in messages) + "\n"


def messages_for(workload: str, schema: dict, instance) -> list[dict]:
    schema_text = compact(schema)
    if workload == "extract":
        record = "\n".join(field_lines(instance))
        content = (
            f"Convert the record below to JSON that matches this JSON Schema.\n\n"
            f"Schema:\n{schema_text}\n\nRecord:\n{record}\n\nAnswer with the JSON only."
        )
    elif workload == "generate":
        content = (
            f"Here is a JSON Schema:\n{schema_text}\n\nWrite one realistic example "
            f"object that matches it. Answer with the JSON only."
        )
    else:
        raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}.")
    return [{"role": "user", "content": content}]


def short_instance(schema: dict, tests: list, sel: Selection):
    """The first instance the dataset marks valid, jsonschema agrees, and that is short enough."""
    for test in tests:
        if not test.get("valid"):
            continue
        text = compact(test.get("data"))
        if sel.min_instance_chars <= len(text) <= sel.max_instance_chars and is_valid(
            schema, test["data"]
        ):
            return test["data"]
    return None


def select_requests(
    gen, workload: str, n: int, sel: Selection, data: Path = DATA, log=print
) -> tuple[list[Request], dict]:
    """``n`` requests (plus one more, first, for warm-up) and the counts of skipped files by
    reason (a schema the library refuses, or whose automaton rejects the expected instance)."""
    files = sorted(p for p in Path(data).glob("*.json"))
    if not files:
        raise SystemExit(f"no schema files in {data}: pass --data DIR (JSONSchemaBench layout).")
    random.Random(sel.seed).shuffle(files)
    skipped: dict[str, int] = {}
    chosen: list[Request] = []
    for path in files:
        if len(chosen) == n + 1:
            break
        reason, request = _try_file(gen, path, workload, sel, len(chosen))
        if request is None:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            chosen.append(request)
    if len(chosen) < n + 1:
        log(f"only {len(chosen)} usable schemas in {data} (wanted {n} + 1 warm-up)")
    return chosen, skipped


def _try_file(gen, path: Path, workload: str, sel: Selection, index: int):
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return "unreadable", None
    schema = entry.get("schema")
    if not isinstance(schema, dict):
        return "schema not an object", None
    if len(compact(schema)) > sel.max_schema_chars:
        return "schema too long", None
    instance = short_instance(schema, entry.get("tests", []), sel)
    if instance is None:
        return "no short valid instance", None
    verdict = _compile_verdict(gen, schema, instance)
    if verdict != "ok":
        return verdict, None
    messages = as_prompt(gen.tokenizer, messages_for(workload, schema, instance))
    prompt_tokens = len(gen.encode_prompt(messages))  # the engine's own encoding
    if prompt_tokens > sel.max_prompt_tokens:
        return "prompt too long", None
    rid = f"{workload}-{index}" if index else f"{workload}-warmup"
    return "ok", Request(
        rid,
        path.name,
        source_of(path.name),
        workload,
        schema,
        messages,
        instance if workload == "extract" else None,
        prompt_tokens,
    )


def _compile_verdict(gen, schema: dict, instance) -> str:
    try:
        constraint = gen.compile(schema=schema)
    except ConstraintError as e:  # UnsupportedSchemaError, SchemaTooComplex included
        return f"refused: {type(e).__name__}"
    except Exception as e:  # a compiler crash is a finding, but not a benchmark request
        return f"compiler crash: {type(e).__name__}"
    try:
        accepted = constraint.accepts(compact(instance))
    except ValueError:  # a byte without a single-byte token
        accepted = False
    return "ok" if accepted else "automaton rejects the instance"


# --- the tiny model of --quick -----------------------------------------------------------------

TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_CORPUS = (
    '{"name": "Alice", "age": 30}',
    '{"name": "Bob", "age": 7, "ok": true}',
    '{"type": "object", "properties": {"id": {"type": "integer"}}}',
    "Convert the record below to JSON that matches this JSON Schema.",
    "Schema: Record: Answer with the JSON only. name: Alice",
    "[1, 2, 3] null false",
)


def tiny_model_and_tokenizer(seed: int = 0):
    """A random 2-layer Llama and a byte-level BPE tokenizer trained here (with a chat
    template): a harness check only."""
    tokenizer = testing.tiny_tokenizer(
        TINY_CORPUS,
        vocab_size=400,
        special_tokens=("<|im_start|>", "<|im_end|>"),
        eos_token="<|im_end|>",
        chat_template=TINY_TEMPLATE,
        bos_token="<|im_start|>",
        pad_token="<|im_end|>",
    )
    return testing.tiny_model(tokenizer, seed, max_positions=4096), tokenizer


# --- scoring a reply against the instance its prompt stated --------------------------------------

MISSING = object()


def leaves_right(expected, got) -> tuple[int, int]:
    """(leaf paths of ``expected`` whose value ``got`` has there, leaf paths): a leaf is a
    scalar or an empty container."""
    if isinstance(expected, dict) and expected:
        pairs = [(v, got.get(k, MISSING) if isinstance(got, dict) else MISSING) for k, v in
                 expected.items()]  # fmt: skip
    elif isinstance(expected, list) and expected:
        pairs = [(v, got[i] if isinstance(got, list) and i < len(got) else MISSING) for i, v in
                 enumerate(expected)]  # fmt: skip
    else:
        return int(got is not MISSING and same(got, expected)), 1
    counts = [leaves_right(e, g) for e, g in pairs]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def same(a, b) -> bool:
    """JSON equality with numbers compared as numbers (1 == 1.0; true is not 1)."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if number(a) and number(b):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
