"""The benchmark harness on its --quick tiny model: files written, correctness fields right.

Timing is never asserted (machines are noisy); validity, greedy identity and the accounting are.
"""

import json
from pathlib import Path

import jsonschema
import pytest

# benchmarks/ is on pytest's pythonpath (pyproject): its scripts import as modules
import report
import run
import torch
import workloads

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
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
    mp = pytest.MonkeyPatch()
    mp.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
    threads = torch.get_num_threads()
    try:
        assert (
            run.main(
                [
                    "--quick",
                    "--data",
                    str(data),
                    "--out",
                    str(out),
                    "--n",
                    "2",
                    "--max-new-tokens",
                    "64",
                    "--configs",
                    CONFIGS,
                ]
            )
            == 0
        )
    finally:
        mp.undo()
        torch.set_num_threads(threads)
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
    assert engine and all(r["finish_reason"] == "stop" for r in engine)  # finite languages
    for row in (r for r in results["results"] if r["status"] == "ok"):
        schema = requests[row["request"]]["schema"]
        try:
            value, parsed = json.loads(row["text"]), True
        except ValueError:
            value, parsed = None, False
        expected = (
            parsed
            and row["finish_reason"] == "stop"
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


@pytest.fixture(scope="module")
def tiny_gen(tmp_path_factory):
    model, tokenizer = workloads.tiny_model_and_tokenizer()
    return run.Generator(model, tokenizer, cache_dir=tmp_path_factory.mktemp("cache"))


REQUEST = workloads.Request(
    "r",
    "f",
    "s",
    "extract",
    SCHEMAS[0],
    workloads.messages_for("extract", SCHEMAS[0], INSTANCES[0]),
    expected=INSTANCES[0],
)


def test_judge_marks_invalid_outputs_and_divergences(tiny_gen):
    greedy, hot = (
        run.Config("x", "engine", "lookup"),
        run.Config("y", "engine", "lookup", temperature=0.7),
    )
    ref = tiny_gen.generate(
        REQUEST.messages, schema=SCHEMAS[0], speculative=False, max_new_tokens=64
    )
    reference = {"token_ids": ref.token_ids, "text": ref.text}
    cases = [
        ('{"color":"green","ok":true}', "stop", True, True),
        ('{"color":"red"}', "stop", False, False),  # a required property missing
        ('{"color":"green","ok":true}', "length", False, True),  # cut: not a finished output
        ('{"color":"green",', "length", False, False),
    ]
    for text, finish, valid, exact in cases:
        row = {"status": "ok", "text": text, "finish_reason": finish, "token_ids": ref.token_ids}
        run.judge(row, REQUEST, hot, reference, tiny_gen)
        assert (row["valid"], row["exact_match"], row["identical"]) == (valid, exact, None)
    row = {"status": "ok", "text": ref.text, "finish_reason": "stop", "token_ids": ref.token_ids}
    run.judge(row, REQUEST, greedy, reference, tiny_gen)
    assert row["identical"] is True and "first_divergence" not in row
    row = {"status": "ok", "text": "", "finish_reason": "length", "token_ids": ref.token_ids[:-1]}
    run.judge(row, REQUEST, greedy, reference, tiny_gen)
    assert row["identical"] is False and row["first_divergence"] == len(ref.token_ids) - 1
    assert row["near_tie"] is False  # a cut output is not a near-tie
    row = {"status": "error", "error": "boom"}
    run.judge(row, REQUEST, greedy, reference, tiny_gen)
    assert "valid" not in row  # crashes are counted as errors, not judged


def test_divergence_gap_points_at_the_first_difference(tiny_gen):
    gen, request = tiny_gen, REQUEST
    ids = gen.generate(
        request.messages, schema=SCHEMAS[0], speculative=False, max_new_tokens=64
    ).token_ids
    assert run.divergence_gap(gen, request, ids, list(ids)) == (None, None)
    constraint = gen.compile(schema=SCHEMAS[0])
    state, i = constraint.initial_state, 0
    while len(constraint.allowed(state)) < 2:  # the first choice the grammar leaves open
        state, i = constraint.step(state, ids[i]), i + 1
    other = next(t for t in constraint.allowed(state) if t != ids[i])
    index, gap = run.divergence_gap(gen, request, ids, ids[:i] + [other])
    assert index == i and gap >= 0


def test_prediction_formula():
    assert report.solve_alpha(1.0, 4) == pytest.approx(0.0, abs=1e-6)
    assert report.solve_alpha(5.0, 4) == pytest.approx(1.0, abs=1e-6)
    alpha = report.solve_alpha(1 + 0.5 + 0.25, 2)
    assert alpha == pytest.approx(0.5)
    assert report.predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert report.predicted_speedup(0.5, 2, 0.5) == pytest.approx(1.75 / 2)


def test_goal_gap_arithmetic():
    """Baseline: 20 ms prefill + 80 ms decode per token. A 3× goal leaves 100/3 − 20 = 13.3 ms
    of decode: a 6× decode speedup. This config decodes at 40 ms (2×) with 3 tokens per call, so
    at the same cost per round it needs 3 × 6/2 = 9."""
    phases = lambda prefill, decode: {
        "setup": 0.0,
        "prefill": prefill,
        "draft": 0.0,
        "verify": decode,
        "other": 0.0,
    }
    summary = {
        "baseline": {
            "config": "baseline",
            "kind": "engine",
            "temperature": 0,
            "speedup": 1.0,
            "phases_ms_per_token": phases(20, 80),
            "verify_ms_per_call": 80.0,
        },
        "lookup": {
            "config": "lookup",
            "kind": "engine",
            "temperature": 0,
            "speedup": 100 / 60,
            "phases_ms_per_token": phases(20, 40),
            "verify_ms_per_call": 120.0,
            "tokens_per_call": 3.0,
            "acceptance": 0.5,
        },
    }
    (gap,) = report.goal_gaps(summary)
    assert gap["config"] == "lookup" and gap["goal"] == report.GOALS["greedy"] == 3.0
    assert gap["decode_speedup"] == pytest.approx(2.0)
    assert gap["decode_speedup_needed"] == pytest.approx(80 / (100 / 3 - 20))
    assert gap["tokens_per_call_needed"] == pytest.approx(3 * gap["decode_speedup_needed"] / 2)
    assert gap["verify_steps"] == pytest.approx(1.5)
    summary["lookup"]["phases_ms_per_token"] = phases(40, 10)  # prefill alone > 100/3 ms
    assert report.goal_gaps(summary)[0]["decode_speedup_needed"] is None
    assert "out of reach" in "\n".join(report._goal_section(report.goal_gaps(summary)))


def test_config_selection():
    names = [c.name for c in run.select_configs("int8+lookup/k[0-9]")]
    assert names == ["baseline"] + [f"int8+lookup/k{k}" for k in (2, 3, 4, 7, 8)]
    assert "int8+lookup/k4@t0.7" in [c.name for c in run.select_configs("int8+lookup/k*")]
    assert "baseline@t0.7" in [c.name for c in run.select_configs("lookup@t0.7")]
    with pytest.raises(SystemExit, match="matches nothing"):
        run.select_configs("nonsense")


def test_field_lines_flatten_nested_values():
    assert workloads.field_lines({"a": {"b": 1}, "c": ["x", None], "d": "two words"}) == [
        "a.b: 1",
        "c[0]: x",
        "c[1]: null",
        "d: two words",
    ]


def test_quick_run_from_a_clone_uses_the_committed_sample(tmp_path, monkeypatch):
    """No --data: the 48 dev-set files committed under benchmarks/data/sample/ are the default."""
    assert workloads.DATA == BENCH / "data" / "sample"
    assert len(list(workloads.DATA.glob("*.json"))) == 48
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        assert (
            run.main(
                [
                    "--quick",
                    "--out",
                    str(tmp_path / "out"),
                    "--n",
                    "1",
                    "--configs",
                    "baseline",
                    "--no-calibrate",
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(workloads.DATA / q["file"]).is_file() for q in results["requests"]] == [True]
