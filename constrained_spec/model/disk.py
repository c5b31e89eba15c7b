"""What the cache dir holds, for ``constrained-spec cache``: its entries (a built-in model's
download and converted copy, each prepared model, the compiled fused layers, the measurements)
with their size and last use, and removing them. What each kind is and how it is rebuilt lives
with its writer (models, prepared, kernels, machine)."""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import models, prepared
from .machine import cache_dir

KINDS = ("model", "prepared", "kernels", "measurements", "other")


@dataclass(frozen=True)
class Entry:
    """One removable thing in the cache dir."""

    name: str  # what `constrained-spec cache --clear NAME` takes
    kind: str  # one of KINDS
    paths: tuple[Path, ...]
    size: int  # bytes
    last_use: float  # seconds since the epoch: its files' latest access or change
    about: str


def entries() -> list[Entry]:
    """Everything under the cache dir, as entries, in the order KINDS lists their kinds."""
    root = cache_dir()
    found: list[Entry] = []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if child.name == "prepared" and child.is_dir():
            found += _prepared(child)
        elif child.name == "kernels" and child.is_dir():
            found += [
                _entry(
                    f"kernels/{k.name}",
                    "kernels",
                    [k],
                    "the kernel library built for this CPU (CONSTRAINED_SPEC_KERNELS=native)",
                )
                for k in sorted(child.iterdir())
            ]
        elif child.name == "calibration.json":
            found.append(_entry("measurements", "measurements", [child], _measurements(child)))
        elif child.name in models.BUILTIN_MODELS and child.is_dir():
            about = "the built-in model: its download and converted copy"
            found.append(_entry(child.name, "model", [child], about))
        else:
            found.append(_entry(child.name, "other", [child], "not written by this version"))
    return sorted(found, key=lambda e: KINDS.index(e.kind))


def _prepared(folder: Path) -> list[Entry]:
    sources = prepared.sources()
    found = [
        _entry(
            f"prepared/{pt.stem}",
            "prepared",
            [pt, pt.with_suffix(".json")],
            sources.get(pt.name) or "a model file no longer indexed",
        )
        for pt in sorted(folder.glob("*.pt"))
    ]
    parts = sorted(folder.glob(".tmp-*"))
    if parts:
        found.append(
            _entry("prepared/unfinished", "prepared", parts, "files of writes that stopped")
        )
    return found


def _measurements(path: Path) -> str:
    try:
        count = len(json.loads(path.read_bytes()))
    except (OSError, ValueError, TypeError, RecursionError):
        return "damaged: measured again when next needed"
    return f"{count} measurements: the kernels' timings and choices, pass costs"


def _entry(name: str, kind: str, paths, about: str) -> Entry:
    files = [p for path in paths for p in ([path] if path.is_file() else path.rglob("*"))]
    size, last = 0, 0.0
    for file in files:
        try:
            stat = file.stat()
        except OSError:  # removed meanwhile
            continue
        if file.is_file():
            size += stat.st_size
        last = max(last, stat.st_atime, stat.st_mtime)
    return Entry(name, kind, tuple(paths), size, last, about)


def matching(name: str | None) -> list[Entry]:
    """The entries ``--clear NAME`` removes: all (None), those of a kind ("prepared",
    "kernels", "measurements", "models"), or the one of that name; ValueError naming the
    choices where none matches."""
    everything = entries()
    if name is None:
        return everything
    kind = {"models": "model"}.get(name, name)
    chosen = [e for e in everything if e.name == name or e.kind == kind]
    if not chosen:
        names = ", ".join(e.name for e in everything) or "none: the cache is empty"
        raise ValueError(
            f"nothing in the cache is named {name!r}: pass an entry's name ({names}) or a kind "
            "(models, prepared, kernels, measurements), or no name to clear everything."
        )
    return chosen


def remove(chosen: list[Entry]) -> None:
    """Remove these entries (and the folders and index they leave empty)."""
    for entry in chosen:
        for path in entry.paths:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    prepared.forget_removed()
    with contextlib.suppress(OSError):
        (cache_dir() / "kernels").rmdir()  # where it is empty
