"""The CLI: --help, bad input (exit 2, one line, no traceback, no model load), the live view."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console

from constrained_spec import cli
from constrained_spec.constraints.grammars import grammar_names
from constrained_spec.generator import Generator, Round

ROOT = Path(__file__).resolve().parent.parent
PERSON = ROOT / "examples" / "person.json"
FLAGS = [
    "--schema",
    "--regex",
    "--grammar",
    "--open-objects",
    "--raw-prompt",
    "--system",
    "--model",
    "--draft",
    "--weights",
    "--dtype",
    "--temperature",
    "--top-k",
    "--top-p",
    "--seed",
    "--max-new-tokens",
    "--no-budget-mask",
    "--loop-guard",
    "--stop",
    "--partial",
    "--num-draft-tokens",
    "--adaptive-k",
    "--no-speculation",
    "--stats",
    "--show",
]


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "constrained_spec", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_documents_every_flag():
    top = run_cli("--help")
    assert top.returncode == 0 and "generate" in top.stdout and "grammars" in top.stdout
    gen = run_cli("generate", "--help")
    assert gen.returncode == 0
    assert [f for f in FLAGS if f not in gen.stdout] == []
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices["generate"]
    undocumented = [a.option_strings for a in sub._actions if a.option_strings and not a.help]
    assert undocumented == []
    assert {a.option_strings[0] for a in sub._actions if a.option_strings} - {"-h"} == set(FLAGS)


def test_grammars_command_lists_every_grammar():
    out = run_cli("grammars")
    assert out.returncode == 0
    assert [n for n in grammar_names() if n not in out.stdout] == []


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load for bad input")

    monkeypatch.setattr(Generator, "from_pretrained", classmethod(refuse))


@pytest.fixture
def not_json(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text("{'type': 'object'")
    return path


BAD = [
    (["--schema", "/does/not/exist.json"], "does not exist"),
    (["--schema", "NOT_JSON"], "not valid JSON"),
    (["--schema", '{"type": "array", "uniqueItems": true}'], "unsupported JSON Schema keyword"),
    (["--schema", '{"type": "objekt"}'], "objekt"),
    (["--grammar", "nope"], "available grammars are"),
    (["--regex", "(ab"], "cannot compile the regex '(ab'"),
    (["--grammar", "BAD_LARK"], "cannot compile the grammar: line 2, column 9"),
    (["--regex", "a", "--weights", "fast"], "invalid choice"),
    (["--regex", "a", "--model", "no-such-model"], "built-in models are smollm2-135m-instruct"),
    (["--regex", "a", "--draft", "no-such-draft"], "--draft 'no-such-draft'"),
    (
        ["--regex", "a", "--model", "owner/model", "--draft", "head"],
        "no trained draft head ships for 'owner/model'",
    ),
    (
        ["--regex", "a", "--temperature", "-1"],
        "--temperature -1.0 must be 0 (greedy) or a finite number",
    ),
    (["--regex", "a", "--top-p", "1.5", "--top-k", "0"], "--top-k 0 must be >= 1; --top-p 1.5"),
    (["--regex", "a", "--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--regex", "a", "--num-draft-tokens", "-2"], "--num-draft-tokens -2 must be >= 0"),
    (["--regex", "a", "--top-k", "many"], "invalid int value"),
    (["--regex", "a", *["--stop", "x"] * 5], "--stop ['x', 'x', 'x', 'x', 'x'] must be a string"),
    (
        ["--regex", "a", "--stop", ""],
        "--stop [''] must be a string or a list of at most 4 non-empty",
    ),
    (["--regex", "a", "--grammar", "uuid"], "not allowed with"),
    ([], "one of the arguments --schema --regex --grammar is required"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_exits_2_with_one_line(args, message, no_model_load, not_json, capsys):
    bad_lark = not_json.with_name("bad.lark")
    bad_lark.write_text('start: x\nx: "a" (\n')
    args = [{"NOT_JSON": str(not_json), "BAD_LARK": str(bad_lark)}.get(a, a) for a in args]
    code = cli.main(["generate", *args, "Extract: Alice, 30"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_empty_prompt_and_unknown_command(no_model_load, capsys):
    assert cli.main(["generate", "--regex", "a", "  "]) == 2
    assert "PROMPT is empty" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--schema", "/does/not/exist.json"], "does not exist"),
        (["--grammar", "nope"], "available grammars are"),
        (["--regex", "a", "--model", "no-such-model"], "built-in models are"),
    ],
)
def test_bad_input_through_the_real_entry_point(args, message):
    out = run_cli("generate", *args, "Extract: Alice, 30")
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


# ---------------------------------------------------------------- the live view, on tiny models


class _Pieces:
    def __init__(self, forced=()):
        self.forced, self.steps = set(forced), []

    def piece(self, token, committed):
        return f"<{token}>" if committed else f"[{token}]"

    def step(self, token):
        self.steps.append(token)
        return token in self.forced


def test_render_round_styles():
    pieces = _Pieces(forced={7})
    text = cli.render_round(
        Round(drafted=[5, 6, 9], accepted=1, token=7, committed=[5, 7]), pieces.piece, pieces.step
    )
    assert text.plain == "<5>[6]<7>"
    styles = [(text.plain[s.start : s.end], str(s.style)) for s in text.spans]
    assert styles == [("<5>", "green"), ("[6]", cli.STRUCK), ("<7>", "blue underline")]
    assert pieces.steps == [5, 7]  # the automaton walks committed tokens only
    bonus = cli.render_round(Round([1, 2], 2, 3, [1, 2, 3]), pieces.piece, pieces.step)
    assert [str(s.style) for s in bonus.spans] == ["green", "green", "blue"]
    eos_in_draft = cli.render_round(Round([1, 0, 4], 2, 8, [1, 0]), pieces.piece, pieces.step)
    assert eos_in_draft.plain == "<1><0>"  # committed was cut after EOS: nothing struck


def test_live_view_follows_generation(tiny_target, tiny_draft, tiny_tokenizer, tmp_path):
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    regex = r'\{"name":"(Alice|Bob|Zoë)","age":[0-9]{1,2}\}'
    console = Console(file=open(tmp_path / "view.txt", "w"), width=100)
    view = cli.RoundView(gen, gen.compile(regex=regex), console)
    meter = cli._Meter()
    result = gen.generate(
        "yes no", regex=regex, max_new_tokens=40, seed=0, on_round=meter.chain(view)
    )
    view.close()
    struck = "".join(
        view.text.plain[s.start : s.end] for s in view.text.spans if str(s.style) == cli.STRUCK
    )
    shown = view.text.plain
    for span in sorted(
        (s for s in view.text.spans if str(s.style) == cli.STRUCK), key=lambda s: -s.start
    ):
        shown = shown[: span.start] + shown[span.end :]
    expected = result.text + ("⏎" if result.finish_reason == "stop" else "")
    assert shown == expected
    assert view.calls == result.stats.target_calls
    assert (
        view.tokens == meter.committed == len(result.token_ids) + (result.finish_reason == "stop")
    )
    assert view.accepted == result.stats.accepted and view.drafted == result.stats.drafted
    assert (struck == "") == (result.stats.accepted == result.stats.drafted)
    assert view.forced >= 7  # '{"name":"' is forced once the first brace is out: ≥ 7 tokens
    table = cli.stats_table(
        result,
        meter,
        0.1,
        0.2,
        cli.build_parser().parse_args(["generate", "--regex", regex, "x"]),
        cli.Invocation({"regex": regex}, "x", "int8"),
    )
    Console(file=open(tmp_path / "stats.txt", "w"), width=120).print(table)
    assert "target calls" in (tmp_path / "stats.txt").read_text()


# ---------------------------------------------------------------- the real default model


@pytest.mark.real_model
def test_generate_on_the_default_model():
    out = run_cli(
        "generate",
        "--schema",
        str(PERSON),
        "--max-new-tokens",
        "48",
        "--stats",
        "--show",
        "--seed",
        "0",
        "Extract: Alice, 30, alice@example.com",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr
    value = json.loads(out.stdout)
    jsonschema.validate(
        value, json.loads(PERSON.read_text()), format_checker=jsonschema.FormatChecker()
    )
    assert "target calls" in out.stderr and "acceptance by position" in out.stderr
    assert "Traceback" not in out.stderr


def test_stop_ends_the_output_before_it(tiny_target, tiny_tokenizer, monkeypatch, capsys):
    gen = Generator(tiny_target, tiny_tokenizer)
    monkeypatch.setattr(Generator, "from_pretrained", classmethod(lambda cls, *a, **k: gen))
    job = ["generate", "--regex", "[a-z ]{0,40}", "--raw-prompt", "hello"]
    assert cli.main(job) == 0
    whole = capsys.readouterr().out.rstrip("\n")
    stop = whole[9:11]
    assert len(stop) == 2 and whole.index(stop) > 0
    assert cli.main(job[:-1] + ["--stop", stop, "--stop", "zzz", "hello"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == whole[: whole.index(stop)]
