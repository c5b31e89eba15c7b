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


def remembered(what: str, measure) -> dict:
    """``measure()``'s result for ``what`` on this CPU, torch version and thread count: from
    the cache's calibration.json, else measured now and written there."""
    key = f"{what} | {cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    path = cache_dir() / "calibration.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    if isinstance(known.get(key), dict):
        return known[key]
    known[key] = result = measure()
    try:
        atomic_write(path, json.dumps(known, indent=1))
    except OSError as err:  # a read-only cache still runs, measuring again next time
        say(f"could not cache the kernel calibration in {path}: {err}")
    return result


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
