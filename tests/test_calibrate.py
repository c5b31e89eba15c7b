"""Measurements you can trust: one taken while other processes kept the CPUs busy is used by
its process but not pinned (the next quiet process measures it again), the load signal is the
others' share of the CPUs, and ``constrained-spec calibrate`` measures everything again on demand
and names each choice with its timings."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from constrained_spec import cli, testing
from constrained_spec.decoding import cost
from constrained_spec.model import machine, models, prepared


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "cache"))
    new_process(monkeypatch)
    return tmp_path / "cache"


def new_process(monkeypatch) -> None:
    for name in ("_provisional", "_measured_now"):
        monkeypatch.setattr(machine, name, {})
    monkeypatch.setattr(machine, "_said_loaded", set())
    monkeypatch.setattr(machine, "_again", False)


def ours(capfd) -> list[str]:
    return [x for x in capfd.readouterr().err.splitlines() if x.startswith("constrained_spec:")]


def an_hour_ago(cache: Path) -> None:
    """Every provisional entry of the cache as if measured an hour earlier."""
    path = cache / "calibration.json"
    entries = json.loads(path.read_text())
    for entry in entries.values():
        entry[machine.MEASURED_AT] -= machine.REMEASURE_S
    path.write_text(json.dumps(entries))


def test_a_measurement_under_load_is_used_for_an_hour_and_measured_again_when_quiet(
    cache, capfd, monkeypatch
):
    calls = []

    def measure():
        calls.append(1)
        return {"ms": 40.0 if load == 0.5 else 20.0}

    load = 0.5  # others' share of the CPUs during the measurement
    monkeypatch.setattr(machine, "others_share", lambda before, after: load)
    assert machine.remembered("layers", measure) == {"ms": 40.0}
    (stored,) = json.loads((cache / "calibration.json").read_text()).values()
    assert stored["ms"] == 40.0 and "50% of the CPUs" in stored[machine.PROVISIONAL]
    (line,) = ours(capfd)
    assert "measured while other processes used 50% of the CPUs" in line
    assert machine.remembered("layers", measure) == {"ms": 40.0}  # this process: kept
    assert len(calls) == 1, "measured twice in one process"

    new_process(monkeypatch)  # within the hour: the provisional one, not measured again
    assert machine.remembered("layers", measure) == {"ms": 40.0} and len(calls) == 1
    assert ours(capfd) == []
    an_hour_ago(cache)
    new_process(monkeypatch)  # an hour on, still loaded: measured again, and not kept either
    assert machine.remembered("layers", measure) == {"ms": 40.0} and len(calls) == 2
    assert "measured under load" in ours(capfd)[0]
    new_process(monkeypatch)  # that one's hour has not passed: not measured again
    assert machine.remembered("layers", measure) == {"ms": 40.0} and len(calls) == 2

    an_hour_ago(cache)
    new_process(monkeypatch)
    load = 0.01  # quiet
    assert machine.remembered("layers", measure) == {"ms": 20.0} and len(calls) == 3
    (stored,) = json.loads((cache / "calibration.json").read_text()).values()
    assert stored == {"ms": 20.0}, "a quiet measurement is pinned, unmarked"
    new_process(monkeypatch)
    load = 0.9  # a later loaded process reads the pinned one: nothing measured
    assert machine.remembered("layers", measure) == {"ms": 20.0} and len(calls) == 3


def test_the_load_signal_is_the_other_processes_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    # (machine busy s, own s, wall s): 3 s busy in 1 s of 2 CPUs, 1 of them ours
    assert machine.others_share((10.0, 2.0, 5.0), (13.0, 3.0, 6.0)) == 1.0
    assert machine.others_share((10.0, 2.0, 5.0), (11.0, 3.0, 6.0)) == 0.0  # only ours
    assert machine.others_share((10.0, 2.0, 5.0), (11.0, 2.0, 5.1)) is None  # too short
    assert machine.others_share(None, (11.0, 2.0, 6.0)) is None  # no /proc/stat


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc/stat")
def test_a_busy_neighbour_is_seen_and_a_quiet_machine_is_not():
    def spin_for(seconds: float) -> float | None:
        before = machine.cpu_times()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return machine.others_share(before, machine.cpu_times())

    quiet = spin_for(0.6)
    if quiet is not None and quiet >= machine.LOADED_SHARE:  # other jobs beside the suite
        pytest.skip(f"the machine is not quiet ({quiet:.0%} used by others): nothing to tell")
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = spin_for(0.6)
    finally:
        neighbour.kill()
        neighbour.wait()
    assert quiet is not None and quiet < machine.LOADED_SHARE, quiet
    assert busy is not None and busy > machine.LOADED_SHARE, busy


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return testing.write_gguf(tmp_path_factory.mktemp("gguf") / "llama.gguf", "llama", "Q4_K")


def test_calibrate_measures_again_and_names_each_choice(cache, capsys, gguf, monkeypatch):
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.0)  # quiet, then busy
    timed = []
    real = cost.measure_rows
    monkeypatch.setattr(cost, "measure_rows", lambda m, r: timed.append(r) or real(m, r))
    assert cli.main(["calibrate", "--model", str(gguf)]) == 0
    prepared.wait()
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert lines[0].startswith(f"model: {gguf}") and "weights int4 (auto: the 4-bit" in lines[0]
    model = models.load_model(str(gguf), weights="int4")[0]
    assert lines[1] == (
        f"kernels (this CPU's features; no timing decides them): 4-bit matmuls {model.matmul}, "
        f"layers {model.layer_kernel}, prompts {model.prefill}, LM head Q8Head"
    )
    assert "pass cost, 1 row (ms): 1 fed " in text and "pass cost, 16 rows (ms): " in text
    assert "acceptance rule per position: sampled " in text
    assert "6 measurements in" in lines[-1] and "all on a quiet machine" in lines[-1]
    assert timed == list(cost.GRID_ROWS)  # each row count of the grid, and the rule

    new_process(monkeypatch)  # cached now; calibrate measures again all the same
    monkeypatch.setattr(machine, "others_share", lambda before, after: 0.45)
    assert cli.main(["calibrate", "--model", str(gguf)]) == 0
    assert timed == 2 * list(cost.GRID_ROWS)
    last = capsys.readouterr().out.splitlines()[-1]
    assert "6 under load: used once, not kept (run calibrate on a quiet machine)" in last
    marked = json.loads((cache / "calibration.json").read_text()).values()
    assert all(machine.PROVISIONAL in v for v in marked)


def test_calibrate_names_a_model_it_cannot_measure(cache, capsys, tmp_path):
    assert cli.main(["calibrate", "--model", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err
    assert "neither a built-in model" in err and "a .gguf file that exists" in err
