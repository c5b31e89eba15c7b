"""The memory and time of a GGUF file's first load: what a user's machine must hold while the
file is converted (no prepared model yet), and what stays resident after it.

    python benchmarks/first_load.py FILE.gguf [FILE.gguf ...]

Each file loads in a fresh process with an empty cache of its own (the compiled fused layers
copied in, so no compile is timed; the kernels' calibration for the file's shape is measured, as
on a user's first load), then the prepared file is written. Prints per file: seconds to the model
loaded, the peak resident memory (VmHWM: it counts the memory-mapped file's pages too, which the
system can reclaim), the anonymous memory after the load (the process's own: what cannot be
reclaimed) and the prepared file's size. Linux only (it reads /proc/self/status).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOAD = """
import json, time
t = time.perf_counter()
from constrained_spec.target import models, prepared
model, _ = models.load_model({path!r}, weights="int4")
loaded = time.perf_counter() - t
prepared.wait()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
gb = lambda key: int(status[key].split()[0]) / 1e6
stored = prepared.path_for(models.model_file({path!r}))
print(json.dumps({{"load_s": loaded, "peak_gb": gb("VmHWM"), "anon_after_gb": gb("RssAnon"),
                  "prepared_gb": stored.stat().st_size / 1e9 if stored.exists() else None}}))
"""


def first_load(path: Path) -> dict:
    from constrained_spec.target.machine import cache_dir

    with tempfile.TemporaryDirectory(prefix="first-load-") as cache:
        shutil.copytree(cache_dir() / "kernels", Path(cache) / "kernels")
        env = os.environ | {
            "CONSTRAINED_SPEC_CACHE": cache,
            "CONSTRAINED_SPEC_CACHE_GB": "64",  # the prepared model is stored whatever its size
            "PYTHONPATH": str(ROOT),
        }
        code = LOAD.format(path=str(path.resolve()))
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            raise SystemExit(f"{path}: the load failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        raise SystemExit(__doc__)
    for path in paths:
        r = first_load(path)
        print(
            f"{path.name}: loaded in {r['load_s']:.0f} s, peak {r['peak_gb']:.2f} GB resident, "
            f"{r['anon_after_gb']:.2f} GB anonymous after the load, prepared "
            f"{r['prepared_gb']:.2f} GB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
