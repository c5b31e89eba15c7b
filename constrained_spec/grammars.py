"""Ready-made constraints shipped in the repository's ``grammars/`` directory, found by name.

Two file kinds, the name is the file name without its suffix:
- ``NAME.regex``: first line ``# one-line description``, then the regex (line breaks removed, so a
  long regex may be wrapped; no other character is stripped).
- ``NAME.json``: a JSON Schema whose top-level ``"description"`` is the one-line description.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConstraintError

GRAMMAR_DIR = Path(__file__).resolve().parent.parent / "grammars"
SUFFIXES = (".regex", ".json")


def _files() -> dict[str, Path]:
    if not GRAMMAR_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(GRAMMAR_DIR.iterdir()) if p.suffix in SUFFIXES}


def grammar_names() -> dict[str, str]:
    """``{name: one-line description}`` of every grammar in ``grammars/``, sorted by name."""
    return {name: _description(path) for name, path in _files().items()}


def load_grammar(name: str) -> dict:
    """``{"regex": str}`` or ``{"schema": dict}`` for a grammar name (see ``grammar_names``)."""
    files = _files()
    if name not in files:
        available = ", ".join(files) or f"none (no grammar files in {GRAMMAR_DIR})"
        raise ConstraintError(f"unknown grammar {name!r}: available grammars are {available}.")
    path = files[name]
    if path.suffix == ".regex":
        return {"regex": _regex_text(path)}
    try:
        schema = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConstraintError(f"grammar file {path} is not valid JSON ({e}).") from None
    return {"schema": schema}


def _regex_text(path: Path) -> str:
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("#"):
        raise ConstraintError(f"grammar file {path} must start with a '# description' line.")
    regex = "".join(lines[1:])
    if not regex:
        raise ConstraintError(f"grammar file {path} has no regex after its description line.")
    return regex


def _description(path: Path) -> str:
    try:
        if path.suffix == ".regex":
            first = path.read_text().split("\n", 1)[0]
            return first.lstrip("#").strip() if first.startswith("#") else ""
        return str(json.loads(path.read_text()).get("description", ""))
    except (OSError, ValueError, AttributeError):
        return "(unreadable grammar file)"
