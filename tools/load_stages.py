"""Where a GGUF's load spends its time and memory, stage by stage: a first load (the file's
header, transformers' tokenizer and config, the repack of every tensor, the head's bound terms,
the prompts' copy, the prepared entry's store) and the second load after it (the stored header,
the repack with the stored terms), in this process, on a fresh cache of its own.

    python tools/load_stages.py FILE.gguf

Each stage: seconds, the process's peak resident memory during it (VmHWM, reset before each
stage through /proc/self/clear_refs) and its resident memory after; under a stage, the seconds
of the functions it spends them in. Linux only.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_spec.model import files, gguf_header, kernels, models, prepared, repack  # noqa: E402
from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.tokenizer import Tokenizer  # noqa: E402

IMPORTED = time.perf_counter()
_inside: dict[str, float] = collections.defaultdict(float)


def _gb(key: str) -> float:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status[key].split()[0]) / 1e6


def stage(name: str, call, *args, **kwargs):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the resident memory now
    start = time.perf_counter()
    result = call(*args, **kwargs)
    seconds = time.perf_counter() - start
    print(f"{name:34s} {seconds:6.2f} s  peak {_gb('VmHWM'):.2f} GB  after {_gb('VmRSS'):.2f} GB")
    for inner in sorted(_inside, key=_inside.get, reverse=True):
        print(f"    {inner:30s} {_inside.pop(inner):6.2f} s")
    return result


def timed(owner, name: str) -> None:
    """Count the seconds spent in owner.name (as a stage's inner lines)."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def counted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _inside[f"{getattr(owner, '__name__', owner)}.{name}"] += time.perf_counter() - start

    setattr(owner, name, counted)


def main(path: Path) -> None:
    for name in ("tiles", "blocks", "dense", "q8_0_rows", "q6_k_rows", "float_rows", "head_parts"):
        timed(repack, name)
    timed(kernels.Q8Head, "_bound_terms")
    timed(kernels.Q8Head, "_kernel_terms")
    timed(gguf_header.GGUFHeader, "release")
    print(f"{'imports':34s} {IMPORTED - START:6.2f} s")
    layout = stage(
        "the kernels and the repack library", lambda: (models.matmul_kernel(), repack.library())[0]
    )
    reader = stage("the file's header", files.read_gguf, path)
    tokenizer = stage("tokenizer (transformers)", models.load_tokenizer, str(path))
    tokenizer = stage("tokenizer (ours, from it)", Tokenizer.of, tokenizer)
    config = stage("config (transformers)", models.load_config, path)
    model = stage(
        "the model laid from the file", files.from_gguf, path, config, layout, reader=reader
    )
    stage("its kernels (the prompts' copy)", models.use_kernels, model)
    stage(
        "pages let go, heap trimmed",
        lambda: (reader.release(reader.tensors), models.release_freed_memory()),
    )
    state = stage(
        "the prepared entry's snapshot", prepared._snapshot, model, tokenizer, reader.state()
    )
    stage("the prepared entry's store", prepared._write, path, *state, prepared.cap_bytes())
    print(f"{'first load':34s} {time.perf_counter() - START:6.2f} s (from the process's start)")
    del model
    models.release_freed_memory()
    start = time.perf_counter()
    stored = stage("second: the prepared entry", prepared.load, path)
    reader = stage("second: the stored header", files.restored_gguf, path, stored.gguf)
    model = stage(
        "second: the model laid", files.from_gguf, path, stored.config, layout, stored.terms, reader
    )
    stage("second: its kernels", models.use_kernels, model)
    print(f"{'second load':34s} {time.perf_counter() - start:6.2f} s (imports not counted)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with tempfile.TemporaryDirectory(prefix="load-stages-") as cache:
        shutil.copytree(cache_dir() / "kernels", Path(cache) / "kernels")  # no compile timed
        os.environ["CONSTRAINED_SPEC_CACHE"] = cache
        main(Path(sys.argv[1]))
