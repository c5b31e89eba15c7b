"""Corpus jobs (constrained-spec batch): resumable JSONL output, bad rows in their own lines,
bad files named by line before any model work."""

import json

import pytest

from constrained_spec import Generator, cli, testing
from constrained_spec.decoding.drafters import CompositeDrafter
from constrained_spec.jobs import JobInputError, done_ids, read_rows, run_job
from constrained_spec.testing import PERSON

REGEX = {"regex": "[a-z ]{2,30}"}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def gen(tiny_int4_target, tiny_tokenizer):
    return Generator(tiny_int4_target, tiny_tokenizer, draft=CompositeDrafter())


ROWS = [{"id": i, "prompt": f"hello {'yes no ' * i}"} for i in range(7)] + [
    {"id": "person", "prompt": "Alice is 30", "schema": PERSON},
    {"id": "refused", "prompt": "hi", "schema": {"type": "string", "format": "uri-template"}},
    {"id": "too long", "prompt": "yes " * 400},
]
# no chat template; room for PERSON's shortest reply (17 tokens), else its row is refused
OPTIONS = dict(max_new_tokens=20, temperature=0.0, raw_prompt=True)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_an_interrupted_job_resumes_with_every_id_once(gen, tmp_path):
    rows = read_rows(write_rows(tmp_path / "in.jsonl", ROWS))
    whole = tmp_path / "whole.jsonl"
    run_job(gen, rows, REGEX, whole, OPTIONS, batch_size=3)

    cut = tmp_path / "cut.jsonl"

    def stop_after_four(finished, total, tokens, seconds):
        if finished == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(gen, rows, REGEX, cut, OPTIONS, 3, stop_after_four)
    assert len(lines(cut)) == 4
    with open(cut, "a") as f:  # a crash in the middle of writing a line
        f.write('{"id": 5, "text": "hel')
    counts = run_job(gen, rows, REGEX, cut, OPTIONS, batch_size=2).counts
    assert counts["skipped"] == 4
    got, expected = lines(cut), lines(whole)
    assert sorted(map(str, (line["id"] for line in got))) == sorted(str(row["id"]) for row in ROWS)
    key = lambda line: str(line["id"])
    for a, b in zip(sorted(got, key=key), sorted(expected, key=key)):
        assert {k: v for k, v in a.items() if k != "stats"} == {
            k: v for k, v in b.items() if k != "stats"
        }


def test_bad_rows_get_their_own_error_lines(gen, tmp_path):
    rows = read_rows(write_rows(tmp_path / "in.jsonl", ROWS))
    summary = run_job(gen, rows, REGEX, tmp_path / "out.jsonl", OPTIONS, batch_size=4)
    counts = summary.counts
    by_id = {line["id"]: line for line in lines(tmp_path / "out.jsonl")}
    assert "uri-template" in by_id["refused"]["error"]
    assert "context" in by_id["too long"]["error"]
    assert by_id["person"]["finish_reason"] in ("stop", "budget")
    assert by_id[0]["stats"]["tokens"] > 0 and by_id[0]["text"]
    assert counts["refused"] == 1 and counts["error"] == 1
    assert counts["stopped"] + counts["length"] == len(ROWS) - 2
    assert sorted(row_id for row_id, _ in summary.failures) == ["refused", "too long"]
    assert not summary.all_failed


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": \n', r"in.jsonl:2: not JSON"),
        (
            '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n',
            "in.jsonl:2: the id 1 appears twice",
        ),
        ('{"prompt": "a"}\n', r"in.jsonl:1: a row is a JSON object with an \"id\""),
        ('{"id": 1}\n', "exactly one of"),
        ('{"id": 1, "prompt": "a", "colour": 2}\n', "unknown: colour"),
        ("\n\n", "has no rows"),
    ],
)
def test_bad_input_files_name_the_line(tmp_path, text, words):
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(JobInputError, match=words):
        read_rows(path)


def test_a_foreign_output_file_is_not_appended_to(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("name,age\nAlice,30\n")
    with pytest.raises(JobInputError, match="out.jsonl:1 is not a result line"):
        done_ids(out)


def test_the_cli_checks_the_job_before_loading(tmp_path, monkeypatch, capsys):
    def explode(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Generator, "from_pretrained", explode)
    bad = tmp_path / "in.jsonl"
    bad.write_text('{"id": 1, "prompt": "a"}\nnot json\n')
    out = str(tmp_path / "out.jsonl")
    assert cli.main(["batch", "--input", str(bad), "--output", out, "--regex", "a+"]) == 2
    assert "in.jsonl:2: not JSON" in capsys.readouterr().err
    good = write_rows(tmp_path / "good.jsonl", [{"id": 1, "prompt": "a"}])
    assert cli.main(["batch", "--input", str(good), "--output", out]) == 2
    assert 'no "schema" and the job has none' in capsys.readouterr().err
    assert (
        cli.main(["batch", "--input", str(good), "--output", out, "--regex", "a", "--top-p", "2"])
        == 2
    )
    assert "top_p" in capsys.readouterr().err


def test_the_job_on_ray_writes_what_the_local_job_writes(tmp_path):
    """A local Ray instance, one actor with its own Generator: the same lines as in-process,
    and a resumed job skips the ids already written."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")
    from constrained_spec.jobs import run_job_on_ray

    rows = read_rows(write_rows(tmp_path / "in.jsonl", ROWS))
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    run_job(testing.tiny_int4_generator(), rows, REGEX, local, OPTIONS, batch_size=3)
    on_ray.write_text("".join(local.read_text().splitlines(keepends=True)[:2]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        counts = run_job_on_ray(
            testing.tiny_int4_generator, rows, REGEX, on_ray, OPTIONS, batch_size=3
        ).counts
    finally:
        ray.shutdown()
    assert counts["skipped"] == 2 and sum(counts.values()) == len(ROWS)
    key = lambda line: str(line["id"])
    strip = lambda line: {k: v for k, v in line.items() if k != "stats"}
    assert sorted(map(strip, lines(on_ray)), key=key) == sorted(map(strip, lines(local)), key=key)


def test_a_prompt_is_one_user_message_unless_raw():
    from constrained_spec.jobs import Row, _request

    row = Row(1, 1, "Alice is 30", None)
    assert _request(row, REGEX, {})["prompt"] == [{"role": "user", "content": "Alice is 30"}]
    assert _request(row, REGEX, {"raw_prompt": True})["prompt"] == "Alice is 30"
    messages = [{"role": "system", "content": "JSON only"}, {"role": "user", "content": "hi"}]
    assert _request(Row(2, 2, messages, None), REGEX, {})["prompt"] == messages


@pytest.fixture
def chat_gen(monkeypatch):
    """A tiny Generator with a chat template, as `constrained-spec batch` loads it."""
    tokenizer = testing.tiny_tokenizer(
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    gen = Generator(testing.tiny_model(tokenizer, seed=0), tokenizer, draft=CompositeDrafter())
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: gen))
    return gen


def test_a_job_in_which_every_row_failed_exits_non_zero(tmp_path, chat_gen, capsys):
    """The summary names each failed row and why; exit 1 when none produced text, 0 when some
    did (the failed ones have their error lines)."""
    refused = {"type": "string", "format": "uri-template"}
    bad = [{"id": "long", "prompt": "yes " * 400}, {"id": "odd", "prompt": "a", "schema": refused}]
    out = tmp_path / "out.jsonl"
    job = ["batch", "--output", str(out), "--regex", "(yes|no)", "--input"]
    assert cli.main(job + [str(write_rows(tmp_path / "bad.jsonl", bad))]) == 1
    err = capsys.readouterr().err
    assert "failed 'long'" in err and "context" in err
    assert "failed 'odd'" in err and "uri-template" in err
    assert "every row failed" in err
    mixed = write_rows(tmp_path / "mixed.jsonl", bad + [{"id": "fine", "prompt": "a"}])
    assert cli.main(job[:2] + [str(tmp_path / "out2.jsonl")] + job[3:] + [str(mixed)]) == 0
    err = capsys.readouterr().err
    assert "failed 'long'" in err and "every row failed" not in err


def test_the_cli_job_takes_messages_rows(tmp_path, chat_gen):
    """A row of chat messages beside a prompt row, through `constrained-spec batch` (the CLI
    passes raw_prompt with every row's options: it once reached a messages row as an unknown
    field, and every such row failed)."""
    messages = [{"role": "user", "content": "yes or no?"}]
    rows = write_rows(
        tmp_path / "in.jsonl", [{"id": 1, "messages": messages}, {"id": 2, "prompt": "a"}]
    )
    out = tmp_path / "out.jsonl"
    assert (
        cli.main(["batch", "--input", str(rows), "--output", str(out), "--regex", "(yes|no)"]) == 0
    )
    got = {line["id"]: line for line in lines(out)}
    assert sorted(got) == [1, 2] and all(line["text"] in ("yes", "no") for line in got.values())
