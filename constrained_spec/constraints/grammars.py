"""Ready-made constraints, the files of the top-level ``grammars/`` folder (shipped in the wheel
as ``constrained_spec.grammars``), by name.

Four file kinds, the name is the file name without its suffix:
- ``NAME.regex``: first line ``# one-line description``, then the regex (line breaks removed, so a
  long regex may be wrapped; no other character is stripped).
- ``NAME.json``: a JSON Schema whose top-level ``"description"`` is the one-line description.
- ``NAME.lark`` / ``NAME.gbnf``: a context-free grammar (llguidance's Lark dialect, or llama.cpp's
  GBNF), first line a comment (``// ...`` / ``# ...``) with the one-line description.
``load_grammar`` also reads a user's file of these kinds by its path.
"""

from __future__ import annotations

import json
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from ..errors import ConstraintError


def _grammar_dir() -> Traversable:
    """The grammars/ folder: an install maps it into the package (pyproject.toml's
    package-dir); a source checkout imported from the tree has it beside the package."""
    try:
        return files("constrained_spec.grammars")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "grammars"


GRAMMAR_DIR = _grammar_dir()
SUFFIXES = (".regex", ".json", ".lark", ".gbnf")


def _files() -> dict[str, Traversable]:
    """``{name: file}``; a package without its grammar files is a broken install, not "none"."""
    found = {}
    if GRAMMAR_DIR.is_dir():
        for entry in GRAMMAR_DIR.iterdir():
            stem, dot, suffix = entry.name.rpartition(".")
            if dot and "." + suffix in SUFFIXES:
                found[stem] = entry
    if not found:
        raise FileNotFoundError(
            f"no grammar files in {GRAMMAR_DIR}: this constrained_spec install "
            f"lacks its package data; reinstall it."
        )
    return dict(sorted(found.items()))


def grammar_names() -> dict[str, str]:
    """``{name: one-line description}`` of every shipped grammar, sorted by name."""
    return {name: _description(path) for name, path in _files().items()}


def grammar_kind(name: str) -> str:
    """A shipped grammar's file kind: "regex", "json" (a schema), "lark" or "gbnf"."""
    return _files()[name].name.rpartition(".")[2]


def load_grammar(name: str) -> dict:
    """``{"regex": str}``, ``{"schema": dict}`` or ``{"grammar": str}`` (Lark/GBNF text) for a
    grammar name (see ``grammar_names``) or the path of a grammar file."""
    files = _files()
    if name in files:
        path = files[name]
    elif Path(name).is_file():
        path = Path(name)
    else:
        raise ConstraintError(
            f"unknown grammar {name!r}: available grammars are {', '.join(files)}; "
            "or pass the path of a .lark, .gbnf, .regex or .json file."
        )
    if path.name.endswith((".lark", ".gbnf")) or not path.name.endswith((".regex", ".json")):
        return {"grammar": path.read_text()}
    if path.name.endswith(".regex"):
        return {"regex": _regex_text(path)}
    try:
        schema = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConstraintError(f"grammar file {path} is not valid JSON ({e}).") from None
    return {"schema": schema}


def _regex_text(path: Traversable) -> str:
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("#"):
        raise ConstraintError(f"grammar file {path} must start with a '# description' line.")
    regex = "".join(lines[1:])
    if not regex:
        raise ConstraintError(f"grammar file {path} has no regex after its description line.")
    return regex


def _description(path: Traversable) -> str:
    try:
        if not path.name.endswith(".json"):  # the first line's comment
            first = path.read_text().split("\n", 1)[0]
            return first.lstrip("#/").strip() if first.startswith(("#", "//")) else ""
        return str(json.loads(path.read_text()).get("description", ""))
    except (OSError, ValueError, AttributeError):
        return "(unreadable grammar file)"
