"""This machine: where caches live, what the CPU is called (a key of every measurement and
compiled kernel), measurements remembered across runs, settings read from the environment, and
one-line status messages on stderr."""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
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
    or a file that does not parse, is measured again, and said so in one line.

    A measurement taken while other processes kept the CPUs busy (``others_share`` over
    LOADED_SHARE) is used but stored as provisional: a process an hour or more later measures
    it again (at most once an hour, however many processes start: a server beside other work
    paid 8-55 s in every process), and keeps it once the machine was quiet (a busy neighbour made
    the fused layers 2-8x slower here and used to be pinned forever). After ``measure_again()``
    every entry is measured once more in this process (``constrained-spec calibrate``)."""
    key = f"{what} | {cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    path = cache_dir() / "calibration.json"
    if (path, key) in _provisional:  # measured under load by this process: not again
        return _provisional[path, key]
    known, damage = _measurements(path)
    stored = known.get(key)
    again = _again and (path, key) not in _measured_now
    if isinstance(stored, dict) and (valid is None or _usable(valid, stored)):
        if not again and (PROVISIONAL not in stored or _recent(stored)):
            return {k: v for k, v in stored.items() if k not in (PROVISIONAL, MEASURED_AT)}
        if not again:
            say(f"{_label(what)} was measured under load ({stored[PROVISIONAL]}); measuring again.")
    elif stored is not None:
        damage = f"its entry for {_label(what)!r} is not one this version reads"
    if damage and path not in _said:  # once a process: the entries after it are the same story
        _said.add(path)
        say(f"{path}: {damage}; measuring again.")
    before = cpu_times()
    result = measure()
    busy = others_share(before, cpu_times())
    _measured_now[path, key] = entry = dict(result)
    if busy is not None and busy > LOADED_SHARE:
        entry[PROVISIONAL] = f"other processes used {busy:.0%} of the CPUs"
        entry[MEASURED_AT] = int(time.time())
        _provisional[path, key] = result
        if _label(what) not in _said_loaded:  # once a process for each kind of measurement
            _said_loaded.add(_label(what))
            say(
                f"{_label(what)}: measured while other processes used {busy:.0%} of the CPUs; "
                "used as it is for an hour, then measured again."
            )
    known, _ = _measurements(path)  # read again: another process may have written meanwhile
    known[key] = entry
    try:
        atomic_write(path, json.dumps(known, indent=1))
    except OSError as err:  # a read-only cache still runs, measuring again next time
        unwritable(err)
    return result


_saying = threading.Lock()  # say()'s lines, and the once-a-process flags read beside them
_said_unwritable = False


def unwritable(err: OSError) -> None:
    """Say once a process that the cache cannot be written (read-only, full, not a folder): the
    model runs from its file all the same, and what is measured is measured again next time."""
    global _said_unwritable
    with _saying:  # the prepared model's writer thread and a measurement may both fail at once
        if _said_unwritable:
            return
        _said_unwritable = True
    why = err.strerror or type(err).__name__
    say(
        f"the cache {cache_dir()} cannot be written ({why}): running from the model's file, "
        f"measuring again in each process; {CACHE_ENV}=<a writable folder> keeps them."
    )


PROVISIONAL = "provisional"  # a stored entry's mark: measured under load, why
MEASURED_AT = "measured_at"  # and when (seconds since the epoch)
REMEASURE_S = 3600.0  # a provisional entry is measured again once it is this old


def _recent(stored: dict) -> bool:
    """Whether a provisional entry was measured less than REMEASURE_S ago."""
    at = stored.get(MEASURED_AT)
    return isinstance(at, (int, float)) and 0 <= time.time() - at < REMEASURE_S


# Above this share of the CPUs used by other processes during a measurement, it is not kept.
# Measured on a 2-core machine around the layers' and linears' measurements: quiet 0.00-0.06, one
# busy `python -c "while True: pass"` beside them 0.34-0.36 (the fused layers 1.6-2x slower, torch's
# linears 1.5x). The load average is not used: a one-minute average that lags a neighbour by
# tens of seconds (1.15 -> 1.56 over a 12 s measurement with one beside it), and stood at 1.1-1.5
# here on quiet runs.
LOADED_SHARE = 0.2
MIN_JUDGED_S = 0.25  # shorter measurements are not judged: /proc/stat counts in 10 ms ticks

_said: set[Path] = set()  # calibration files whose damage was said
_said_loaded: set[str] = set()  # kinds of measurement said to be taken under load
_provisional: dict[tuple[Path, str], dict] = {}  # measured under load by this process
_measured_now: dict[tuple[Path, str], dict] = {}  # everything measured by this process
_again = False


def measure_again() -> None:
    """Measure every cached measurement again (once) in this process, whatever is stored."""
    global _again
    _again = True


def measured_now() -> dict[str, dict]:
    """What this process measured, by key: each entry as stored (PROVISIONAL where under load)."""
    return {key: entry for (_, key), entry in _measured_now.items()}


def _label(what: str) -> str:
    return what.split(" | ")[0][:60]


def cpu_times() -> tuple[float, float, float] | None:
    """(the machine's busy CPU seconds, this process's CPU seconds, wall seconds) now; None
    where /proc/stat cannot be read (not Linux: measurements there are always kept)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    own = os.times()  # with the children it waited for (a kernel compile is ours)
    ours = own.user + own.system + own.children_user + own.children_system
    return busy, ours, time.perf_counter()


def others_share(before, after) -> float | None:
    """The share of this machine's CPUs other processes used between two ``cpu_times()``;
    None where unknown or the span too short to tell."""
    if before is None or after is None or after[2] - before[2] < MIN_JUDGED_S:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(others, 0.0) / ((after[2] - before[2]) * (os.cpu_count() or 1))


# --- threads that follow the free cores -------------------------------------------------------------

FOLLOW_ENV = "CONSTRAINED_SPEC_FOLLOW_CORES"  # "0": torch's thread count whatever the load
# On this 2-core machine, the default model's greedy extraction (quiet: 289 tok/s on 2 threads,
# 192 on 1): with one busy `python -c "while True: pass"` beside it, 73 tok/s on 2 threads
# (a barrier waits for the thread the OS has descheduled) and 185 on 1; OMP_WAIT_POLICY=passive
# kept 140 busy but cost quiet runs the same (140). Replies do not depend on the thread count
# (tests/test_threads.py), so the count may change between any two passes.
_follow: dict = {"at": None, "ceiling": None, "set": None}


def follow_free_cores() -> int:
    """Run torch, and so our kernels (they take its count), on the cores that other processes
    left free over the last MIN_JUDGED_S or more: at most the thread count the user (or torch)
    set, at least one. Cheap between judgements (a clock read); returns the threads now."""
    current = torch.get_num_threads()
    if os.environ.get(FOLLOW_ENV, "").strip() == "0":
        return current
    if current != _follow["set"]:  # the first call, or the user set a count since: the ceiling
        _follow["ceiling"] = _follow["set"] = current
    before = _follow["at"]
    if before is not None and time.perf_counter() - before[2] < MIN_JUDGED_S:
        return current
    _follow["at"] = after = cpu_times()
    share = others_share(before, after)
    if share is None:
        return current
    cores = os.cpu_count() or 1
    wanted = max(1, min(_follow["ceiling"], round(cores * (1.0 - share))))
    if wanted != current:
        torch.set_num_threads(wanted)
        _follow["set"] = wanted
    return wanted


def _measurements(path: Path) -> tuple[dict, str]:
    """calibration.json's entries, and what is wrong with the file ("" if nothing: missing is
    not damaged). A damaged file's entries are all measured again."""
    try:
        known = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):  # (a cache that cannot be written says so)
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
    """One line on stderr, written whole: print() writes the text and its newline apart, so
    two threads' lines (the prepared model's writer, a measurement) could run into one."""
    with _saying:
        sys.stderr.write(f"constrained_spec: {message}\n")
        sys.stderr.flush()


def release_freed_memory() -> None:
    """Hand the memory freed by a model's conversion back to the system: glibc's malloc keeps
    freed blocks of its heap resident for reuse (1.1 GB of them after a 1B GGUF's first load),
    ``malloc_trim`` returns their pages. Nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl; Windows: no CDLL(None))
        pass
