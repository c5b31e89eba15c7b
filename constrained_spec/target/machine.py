"""This machine: where caches live, what the CPU is called (a key of every measurement and
compiled kernel), measurements remembered across runs, settings read from the environment, and
one-line status messages on stderr."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import SettingError

CACHE_ENV = "CONSTRAINED_SPEC_CACHE"
DEFAULT_CACHE = "~/.cache/constrained_spec"


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache root: ``path`` if given, else `$CONSTRAINED_SPEC_CACHE`, else
    `~/.cache/constrained_spec`; `~` expanded, and "" (an empty setting) means the default.
    Converted models, compiled kernels and calibration.json live here."""
    for choice in (path, os.environ.get(CACHE_ENV)):
        if choice is not None and str(choice).strip():
            return Path(choice).expanduser()
    return Path(DEFAULT_CACHE).expanduser()


def cpu_name() -> str:
    """This CPU's model name: part of the key of every cached measurement and compiled kernel."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def remembered(what: str, measure, valid=None) -> dict:
    """``measure()``'s result for ``what`` on this CPU, torch version and thread count: from
    the cache's calibration.json, else measured now and written there. ``valid(result)`` says
    whether a stored result can be used (its fields there and of their types): one that cannot,
    or a file that does not parse, is measured again, and said so in one line."""
    key = f"{what} | {cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    path = cache_dir() / "calibration.json"
    known, damage = _measurements(path)
    stored = known.get(key)
    if isinstance(stored, dict) and (valid is None or _usable(valid, stored)):
        return stored
    if stored is not None:
        damage = f"its entry for {what.split(' | ')[0]!r} is not one this version reads"
    if damage and path not in _said:  # once a process: the entries after it are the same story
        _said.add(path)
        say(f"{path}: {damage}; measuring again.")
    known[key] = result = measure()
    try:
        atomic_write(path, json.dumps(known, indent=1))
    except OSError as err:  # a read-only cache still runs, measuring again next time
        say(f"could not cache the kernel calibration in {path}: {err}")
    return result


_said: set[Path] = set()  # calibration files whose damage was said


def _measurements(path: Path) -> tuple[dict, str]:
    """calibration.json's entries, and what is wrong with the file ("" if nothing: missing is
    not damaged). A damaged file's entries are all measured again."""
    try:
        known = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}, ""
    except (OSError, ValueError, RecursionError) as err:  # unreadable, cut short, not JSON
        return {}, f"unreadable ({type(err).__name__})"
    return (known, "") if isinstance(known, dict) else ({}, "not a JSON object")


def _usable(valid, stored: dict) -> bool:
    try:
        return bool(valid(stored))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def setting(name: str, default: float, zero: str = "no limit") -> float:
    """A limit from the environment (``zero``: what 0 means); SettingError names a bad value."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise SettingError(
            f"{name}={text!r} is not a limit: set a finite number >= 0 (0 = {zero}), "
            f"or unset it for the default {default:g}."
        )
    return value


def say(message: str) -> None:
    print(f"constrained_spec: {message}", file=sys.stderr, flush=True)
