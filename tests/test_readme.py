"""The README as a user reads it: its quickstart command and its Python example, run as written on
the real default model, extract every value of the input (not merely valid JSON)."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# what the quickstart's input states; each value is checked to be in the README's prompt too
PERSON = {"name": "Alice", "age": 30, "email": "alice@example.com"}


def _blocks(language: str, section: str) -> list[str]:
    """The ``language`` code blocks of the README's ``## section``."""
    part = README.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", part, re.S)


def _quickstart_command() -> list[str]:
    (command,) = [
        line
        for block in _blocks("bash", "Quickstart")
        for line in block.splitlines()
        if line.startswith("constrained-spec generate")
    ]
    return shlex.split(command)


def _check_person(value, prompt: str) -> None:
    assert value == PERSON, f"extracted {value}, the input states {PERSON}"
    assert all(str(v) in prompt for v in PERSON.values()), "the README's prompt changed"


def test_the_quickstart_and_the_python_example_are_found():
    """The parsing the real-model tests rely on finds what they run (offline)."""
    args = _quickstart_command()
    assert args[:4] == ["constrained-spec", "generate", "--schema", "examples/person.json"]
    (python,) = _blocks("python", "Python")[:1]
    assert "Generator.from_pretrained()" in python and "res = gen.generate(" in python
    assert f"'{json.dumps(PERSON, separators=(',', ':'))}'" in python  # the output it shows


@pytest.mark.real_model
def test_the_quickstart_command_extracts_every_value():
    args = _quickstart_command()
    out = subprocess.run(
        [sys.executable, "-m", "constrained_spec", *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr
    _check_person(json.loads(out.stdout), " ".join(args))
    assert "acceptance by position" in out.stderr  # --stats, as the README shows it


@pytest.mark.real_model
def test_the_python_example_extracts_every_value(monkeypatch):
    (python,) = _blocks("python", "Python")[:1]
    monkeypatch.chdir(ROOT)  # its schema path is relative to the checkout
    namespace: dict = {}
    exec(compile(python, "README.md (Python)", "exec"), namespace)
    res = namespace["res"]
    _check_person(res.value, python)
    assert res.finish_reason == "stop"
    assert res.text == json.dumps(PERSON, separators=(",", ":"))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_link_of_the_readme_and_docs_resolves():
    """Relative links (and their #anchors) in README.md and docs/*.md name files and headings
    that exist."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked, broken = 0, []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert checked > 20 and broken == []


def test_the_readme_stays_short():
    """What, install, first run, API, limits, current numbers: reference material lives in
    docs/ (docs/usage.md, docs/models.md, ...)."""
    lines = README.count("\n")
    assert 100 < lines <= 250, f"README.md has {lines} lines: move reference material to docs/"
