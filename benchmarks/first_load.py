"""The time and memory of a GGUF file's first load, of the load after it, and the disk the first
one wrote beside the model: what a user's machine meets when it brings a model.

    python benchmarks/first_load.py FILE.gguf [FILE.gguf ...]

Each file loads in a fresh process with an empty cache of its own (the compiled kernels copied
in, so no compile is timed: the fused layers and the GGUF repack), under the default cap on
prepared models; then again in a second fresh process on the cache the first one left. Prints per
file and load: seconds from the process's start to the model loaded (imports included), the peak
resident memory (VmHWM: it counts the memory-mapped file's pages too, which the system can
reclaim), the anonymous memory after the load (the process's own: what cannot be reclaimed); and
the bytes the first load stored (model.prepared). Also the CPU time the process took to the
model loaded, all threads: on a machine shared with other work, where the seconds depend on
what else runs, it tells what the load costs. Linux only (it reads /proc/self/status).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOAD = """
import time
start = time.perf_counter()
import json, resource
from constrained_spec.model import models, prepared
model, _ = models.load_model({path!r}, weights="int4")
loaded = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
prepared.wait()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
gb = lambda key: int(status[key].split()[0]) / 1e6
stored = prepared.path_for(models.model_file({path!r}))
written = sum(p.stat().st_size for p in (stored, stored.with_suffix(".json")) if p.exists())
print(json.dumps({{"load_s": loaded, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "peak_gb": gb("VmHWM"), "anon_after_gb": gb("RssAnon"), "stored_gb": written / 1e9}}))
"""


def loads(path: Path) -> list[dict]:
    """The first and the second load of ``path``, each in a fresh process, on one new cache."""
    with tempfile.TemporaryDirectory(prefix="first-load-") as cache:  # the kernels: prebuilt
        env = os.environ | {"CONSTRAINED_SPEC_CACHE": cache, "PYTHONPATH": str(ROOT)}
        env.pop("CONSTRAINED_SPEC_CACHE_GB", None)  # the default cap, as a user has it
        code = LOAD.format(path=str(path.resolve()))
        results = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
            )
            if out.returncode != 0:
                raise SystemExit(f"{path}: the load failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        return results


def main(argv=None) -> int:
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])]
    if not paths:
        raise SystemExit(__doc__)
    for path in paths:
        first, second = loads(path)
        size = path.stat().st_size / 1e9
        for name, r in (("first", first), ("second", second)):
            print(
                f"{path.name}: {name} load {r['load_s']:.1f} s ({r['cpu_s']:.1f} s of CPU time), "
                f"peak {r['peak_gb']:.2f} GB "
                f"resident, {r['anon_after_gb']:.2f} GB anonymous after the load",
                flush=True,
            )
        stored = first["stored_gb"]
        print(f"{path.name}: stored {stored:.3f} GB beside the {size:.2f} GB file", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
