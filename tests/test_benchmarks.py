"""The benchmark harness on its --quick tiny model, run as a user runs it from a clone (a
subprocess): files written, correctness fields right. Timing is never asserted (machines are
noisy); validity, greedy identity and the accounting are."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# Finite languages: a random model's masked output always finishes within max_new_tokens.
SCHEMAS = [
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "size": {"enum": ["small", "large"]},
            "tag": {"type": "string", "maxLength": 3},
        },
        "required": ["size", "tag"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"name": {"enum": ["Alice", "Bob"]}, "admin": {"type": "boolean"}},
        "required": ["name", "admin"],
        "additionalProperties": False,
    },
]
INSTANCES = [
    {"color": "green", "ok": True},
    {"size": "large", "tag": "abc"},
    {"name": "Alice", "admin": False},
]
CONFIGS = (
    "baseline,forced,lookup,int8/k2,int8+lookup/adaptive,int8+lookup/k4@t0.7,"
    "hf+outlines,hf-assisted-lookup+outlines"
)


def run_harness(*args: str, cache: Path) -> None:
    """benchmarks/run.py with ``args``, in a fresh process (one thread, as --quick sets)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", *args],
        cwd=ROOT,
        env={**__import__("os").environ, "CONSTRAINED_SPEC_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    for i, (schema, instance) in enumerate(zip(SCHEMAS, INSTANCES)):
        (data / f"Handwritten_{i}.json").write_text(
            json.dumps(
                {
                    "schema": schema,
                    "tests": [{"valid": True, "data": instance}, {"valid": False, "data": {}}],
                }
            )
        )
    args = ["--data", str(data), "--out", str(out), "--n", "2", "--max-new-tokens", "64",
            "--configs", CONFIGS]  # fmt: skip
    run_harness(*args, cache=tmp_path_factory.mktemp("cache"))
    return out, json.loads((out / "results.json").read_text())


def test_quick_run_writes_every_output(quick_run):
    out, results = quick_run
    for name in (
        "results.json",
        "results.jsonl",
        "requests.json",
        "report.md",
        "summary.json",
        "speedup_by_config.png",
        "speedup_distribution.png",
        "acceptance_by_position.png",
        "speedup_vs_k.png",
        "phase_breakdown.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "--quick" in results["meta"]["command"] and results["meta"]["machine"]["cpus"]
    assert len(results["requests"]) == 2
    names = [c["name"] for c in results["meta"]["configs"]]
    assert "baseline@t0.7" in names  # added: sampled configs need their own baseline
    for name in names:  # every configuration ran every request; crashes are rows too
        rows = [r for r in results["results"] if r["config"] == name]
        assert sorted(r["request"] for r in rows) == sorted(q["id"] for q in results["requests"])
        assert all(r["status"] in ("ok", "error", "unavailable") for r in rows)
        assert f"`{name}`" in (out / "report.md").read_text()


def test_validity_and_identity_fields(quick_run):
    _, results = quick_run
    requests = {q["id"]: q for q in results["requests"]}
    engine = [
        r
        for r in results["results"]
        if r["status"] == "ok" and not r["config"].startswith(("hf", "outlines"))
    ]
    assert engine and all(r["finish_reason"] in ("stop", "budget") for r in engine)  # in time
    for row in (r for r in results["results"] if r["status"] == "ok"):
        schema = requests[row["request"]]["schema"]
        try:
            value, parsed = json.loads(row["text"]), True
        except ValueError:
            value, parsed = None, False
        expected = (
            parsed
            and row["finish_reason"] != "length"
            and jsonschema.Draft202012Validator(schema).is_valid(value)
        )
        assert row["valid"] == expected
        assert row["exact_match"] == (parsed and value == requests[row["request"]]["expected"])
        assert row["output_tokens"] == len(row["token_ids"])
    assert all(r["valid"] for r in engine)  # the engine emits only what the schema accepts
    for row in engine:
        if row["temperature"] == 0:  # greedy: identical to the baseline, or a marked near-tie
            assert row["identical"] or row["near_tie"], row
        else:
            assert row["identical"] is None
        if row["config"] == "int8/k2":
            assert row["drafted_by_source"].keys() == {"model"}
            assert row["committed_tokens"] == row["output_tokens"] + 1
            assert sum(row["accepted_lengths"]) == row["target_calls"]
            assert row["forward_calls"] == row["target_calls"] + 1  # + the prompt's prefill


def test_summary_accounting(quick_run):
    out, results = quick_run
    summary = json.loads((out / "summary.json").read_text())["summary"]
    base = summary["baseline"]
    assert base["speedup"] == pytest.approx(1.0) and base["tokens_per_call"] == pytest.approx(1.0)
    lookup = summary["lookup"]
    rows = [r for r in results["results"] if r["config"] == "lookup"]
    assert lookup["drafted"] == sum(r["drafted"] for r in rows)
    assert lookup["by_source"] and "model" not in lookup["by_source"]  # no draft model there
    assert "speedups" in summary["int8+lookup/k4@t0.7"]  # ÷ baseline@t0.7
    assert summary["int8/k2"]["cost_ratio"] is not None


def test_quick_run_from_a_clone_uses_the_committed_sample(tmp_path):
    """No --data: the 48 dev-set files committed under benchmarks/data/sample/ are the default."""
    sample = BENCH / "data" / "sample"
    assert len(list(sample.glob("*.json"))) == 48
    out = tmp_path / "out"
    run_harness(
        "--out", str(out), "--n", "1", "--configs", "baseline", "--no-calibrate", cache=tmp_path
    )
    results = json.loads((out / "results.json").read_text())
    assert [(sample / q["file"]).is_file() for q in results["requests"]] == [True]


def test_a_model_without_a_chat_template_is_prompted_in_plain_text(monkeypatch):
    """The benchmarks run a base model's file (Gemma 3 270M has no chat template): each
    request's messages become their contents as plain text, for ours and llama.cpp alike."""
    monkeypatch.syspath_prepend(str(BENCH))
    import workloads
    from run import chat_text

    messages = [{"role": "user", "content": "Extract: Alice, 30"}]
    instruct = SimpleNamespace(
        chat_template="{{ m }}", apply_chat_template=lambda m, **_: f"<user>{m[0]['content']}"
    )
    base = SimpleNamespace(chat_template=None)
    assert workloads.as_prompt(instruct, messages) is messages
    assert workloads.as_prompt(base, messages) == "Extract: Alice, 30\n"
    assert workloads.as_prompt(base, workloads.as_prompt(base, messages)) == "Extract: Alice, 30\n"
    assert chat_text(instruct, messages) == "<user>Extract: Alice, 30"
    assert chat_text(instruct, "Extract: Alice, 30\n") == "Extract: Alice, 30\n"
