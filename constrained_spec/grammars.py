"""Ready-made constraints shipped inside the package (``constrained_spec/grammar_files/``), by name.

Two file kinds, the name is the file name without its suffix:
- ``NAME.regex``: first line ``# one-line description``, then the regex (line breaks removed, so a
  long regex may be wrapped; no other character is stripped).
- ``NAME.json``: a JSON Schema whose top-level ``"description"`` is the one-line description.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import TYPE_CHECKING

from .errors import ConstraintError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

GRAMMAR_DIR = files(__package__) / "grammar_files"  # package data (pyproject.toml), not a repo path
SUFFIXES = (".regex", ".json")


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


def load_grammar(name: str) -> dict:
    """``{"regex": str}`` or ``{"schema": dict}`` for a grammar name (see ``grammar_names``)."""
    files = _files()
    if name not in files:
        raise ConstraintError(
            f"unknown grammar {name!r}: available grammars are {', '.join(files)}."
        )
    path = files[name]
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
        if path.name.endswith(".regex"):
            first = path.read_text().split("\n", 1)[0]
            return first.lstrip("#").strip() if first.startswith("#") else ""
        return str(json.loads(path.read_text()).get("description", ""))
    except (OSError, ValueError, AttributeError):
        return "(unreadable grammar file)"
