"""GGUF rows straight into the 4-bit kernels' layouts (csrc/repack.cpp, through ctypes): what
kernels.Int4Linear and kernels.BlockRows build from a file's blocks with torch ops, bit for bit,
in seconds and with no temporaries beyond a tile of rows (tests compare both for every type and
layout). A weight is given as its rows (``Rows``: a pointer to each row's blocks and its ggml
type), so a llama file's q/k un-permutation, partial rotary's row order, stacked tensors and a
head's padding are only an order of pointers.

``library()`` finds the compiled code: the kernel library (model/compiled.py) that this
process runs, which holds it beside the fused layers; None where none runs, and the callers then
take the torch path (files.py, models.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import compiled
from .machine import say

VERSION = 1  # cs_repack_version(): the interface this module calls
# Or-ed into a row's type: re-quantize it to Q8_0 even where its blocks are Q8_0 (csrc REQUANTIZE)
REQUANTIZE = 0x100
TILE_ROWS, BLOCK_ROWS, GROUP = 16, 8, 32
AFFINE = (2, 3, 6, 7, 12, 13)  # Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K (not or-ed with REQUANTIZE)

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
_SIGNATURES = {
    "cs_repack_version": [],
    "cs_tiles": [_I64, _I64, _P, _P, _I32, _P, _P],
    "cs_blocks": [_I64, _I64, _P, _P, _I32, _I32, _I32, _P, _P, _P],
    "cs_dense": [_I64, _I64, _P, _P, _I32, _I32, _P],
    "cs_dequantized": [_I64, _I64, _P, _P, _I32, _P],
    "cs_head_parts": [_I64, _I64, _P, _P, _P, _P, _P],
    "cs_q8_0_rows": [_I64, _I64, _P, _P, _P, _P],
    "cs_q6_k_rows": [_I64, _I64, _P, _P, _P, _P],
    "cs_float_rows": [_I64, _I64, _P, _P, _P],
    "cs_q8_0_quantize": [_I64, _I64, _P, _P, _P, _P],
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The repack functions of the kernel library this process runs, or None where none runs
    (compiled.load says why, once) or it is another version's (said here)."""
    kernels = compiled.load()[0]
    if kernels is None:
        return None
    lib = kernels.lib
    for name, arguments in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, ctypes.c_int32
    if lib.cs_repack_version() != VERSION:
        say("the kernel library's GGUF repack is another version: converting with torch ops")
        return None
    return lib


@dataclass(frozen=True)
class Rows:
    """A weight's rows, in order, each where its blocks lie: ``pointers`` (n,) uint64 addresses,
    ``types`` (n,) int32 ggml types (or-ed with REQUANTIZE), ``k`` values a row; ``keep``: the
    buffers the pointers point into, held while the rows are used."""

    pointers: np.ndarray
    types: np.ndarray
    k: int
    keep: tuple = ()

    def __len__(self) -> int:
        return len(self.pointers)

    @classmethod
    def of(cls, data: np.ndarray, kind: int, k: int, order: np.ndarray | None = None) -> Rows:
        """The rows of a tensor's blocks ``data`` (rows, bytes) uint8, of ggml type ``kind``,
        taken in ``order`` (row indices; all of them in turn where None)."""
        rows, stride = data.shape[0], data.strides[0]
        order = np.arange(rows) if order is None else np.asarray(order)
        pointers = data.ctypes.data + order.astype(np.uint64) * np.uint64(stride)
        return cls(pointers, np.full(len(order), kind, np.int32), k, (data,))

    def __add__(self, other: Rows) -> Rows:  # stacked: self's rows, then other's
        assert self.k == other.k, (self.k, other.k)
        return Rows(
            np.concatenate((self.pointers, other.pointers)),
            np.concatenate((self.types, other.types)),
            self.k,
            self.keep + other.keep,
        )

    def take(self, order: np.ndarray) -> Rows:
        return Rows(self.pointers[order], self.types[order], self.k, self.keep)

    def padded(self, rows: int) -> Rows:
        """Zero rows (Q8_0 blocks of d = 0, q = 0) after these, up to ``rows``."""
        zeros = np.zeros(self.k // GROUP * 34, np.uint8)
        pad = Rows.of(zeros[None], 8, self.k, np.zeros(rows - len(self), np.int64))
        return self + pad

    def requantized(self) -> Rows:
        return Rows(self.pointers, self.types | REQUANTIZE, self.k, self.keep)


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def _run(name: str, rows: Rows, unit: int, settings: tuple, outputs: tuple, facts: int = 0):
    """The C function ``name`` over ``rows`` — (n, k, pointers, types, *settings, *outputs[,
    facts]) — in parallel: a range of whole units of rows (a tile's 16 or 8) a call, each on
    one of our threads (a ctypes call lets the GIL go), each output's rows at its range. Not
    OpenMP: its workers spin while they wait (torch's OpenMP runtime, which a library that
    links libgomp shares), which made the repack 3-7x slower while other processes used the
    cores. Returns each range's ``facts`` int32s."""
    function, n = getattr(library(), name), len(rows)
    bounds = _ranges(n, unit)
    found = np.zeros((len(bounds), max(facts, 1)), np.int32)

    def call(i: int) -> int:
        start, stop = bounds[i]
        at = [_ptr(out) + start * (out.nbytes // n) for out in outputs]
        pointers = _ptr(rows.pointers) + 8 * start
        types = _ptr(rows.types) + 4 * start
        extra = [_ptr(found[i])] if facts else []
        return function(stop - start, rows.k, pointers, types, *settings, *at, *extra)

    if len(bounds) == 1:
        statuses = [call(0)]
    else:
        statuses = list(_pool().map(call, range(len(bounds))))
    if any(statuses):
        raise ValueError(f"repack: {name} got rows of a type or form it does not lay")
    return found


def _ranges(n: int, unit: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of whole units covering n rows: a few per thread (so that a slow
    thread's share is small), at least 64 rows each."""
    units, threads = n // unit, _threads()
    per = max(-(-units // (4 * threads)), -(-64 // unit), 1)
    return [(a * unit, min(a + per, units) * unit) for a in range(0, units, per)] or [(0, 0)]


def _threads() -> int:
    return max(torch.get_num_threads(), 1)


def _pool() -> ThreadPoolExecutor:
    return _pool_of(os.getpid())


@functools.cache
def _pool_of(process: int) -> ThreadPoolExecutor:
    """One pool a process: a forked child has none of its parent's threads (a pool it
    inherited would never run what it is given)."""
    return ThreadPoolExecutor(_threads(), thread_name_prefix="repack")


def tiles(rows: Rows, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our AVX-512 BF16 / AMX kernels' weights (kernels._tile_pack): tiles (n/16, copies·k/8,
    16) int32 and scales (n/16, copies·k/32, 2, 16) bf16."""
    n, width = len(rows), copies * rows.k
    assert n % TILE_ROWS == 0, n
    packed = torch.empty(n // TILE_ROWS, width // 8, TILE_ROWS, dtype=torch.int32)
    scales = torch.empty(n // TILE_ROWS, width // GROUP, 2, TILE_ROWS, dtype=torch.bfloat16)
    _run("cs_tiles", rows, TILE_ROWS, (copies,), (packed, scales))
    return packed, scales


def blocks(rows: Rows, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc/blocks.h's weights (kernels._blocks_pack in the form kernels._blocks_form chooses):
    tiles (n/8, k·bits/32, 8) int32 and scales (n/8, k/32, planes, 8) bf16. Two copies are laid
    in the form their types imply (8-bit tiles where any row is 8-bit: Q8_0 or re-quantized,
    the high halves' zeros kept where any row is affine; else 5-bit), and laid again in the
    form the values ask for where that differs (all 8-bit rows below −96, all scales 0)."""
    if copies == 1:
        return _blocks(rows, 1, 4, True)[:2]
    affine = np.isin(rows.types, AFFINE)
    form = (5, True) if affine.all() else (8, bool(affine.any()))
    while True:
        packed, scales, (top, zeros) = _blocks(rows, 2, *form)
        bits = 8 if top > 1 else 5
        if (bits, bits == 5 or bool(zeros)) == form:
            return packed, scales
        form = (bits, bits == 5 or bool(zeros))


def _blocks(rows: Rows, copies: int, bits: int, high: bool):
    n, groups = len(rows), rows.k // GROUP
    assert n % BLOCK_ROWS == 0, n
    planes = 2 if copies == 1 or not high else 3
    packed = torch.empty(n // BLOCK_ROWS, groups * bits, BLOCK_ROWS, dtype=torch.int32)
    scales = torch.empty(n // BLOCK_ROWS, groups, planes, BLOCK_ROWS, dtype=torch.bfloat16)
    settings = (copies, bits, int(high))
    found = _run("cs_blocks", rows, BLOCK_ROWS, settings, (packed, scales), facts=2)
    return packed, scales, (int(found[:, 0].max()), int(found[:, 1].max()))


def dense(rows: Rows, copies: int, tiled: bool) -> torch.Tensor:
    """The prompts' bf16 copy of the weights (kernels.Int4Linear.dequantized_bf16): (n, k), or
    ``tiled`` in AMX B tiles (n/16, k/32, 16, 32) (Int4Linear.use_prefill's dense kernels)."""
    n, k = len(rows), rows.k
    shape = (n // TILE_ROWS, k // GROUP, TILE_ROWS, GROUP) if tiled else (n, k)
    out = torch.empty(*shape, dtype=torch.bfloat16)
    _run("cs_dense", rows, TILE_ROWS if tiled else 1, (copies, int(tiled)), (out,))
    return out


def dequantized(rows: Rows, copies: int) -> torch.Tensor:
    """The weights (n, copies·k) float32 the kernels' scales give (Int4Linear.dequantized)."""
    out = torch.empty(len(rows), copies * rows.k)
    _run("cs_dequantized", rows, 1, (copies,), (out,))
    return out


def head_parts(rows: Rows, out: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What kernels.Q8Head's bound terms are norms of, for a head's screen rows (two halves of
    Q8_0 blocks): w = hi + lo, |hi| + |lo| and w − the rows' float32 values, each (n, k), into
    the first n rows of ``out``'s three (a slice at a time, the same buffers each time: new ones
    each slice left a 150k vocabulary's load 1.5 GB of freed heap at its peak)."""
    parts = tuple(t[: len(rows)] for t in out)
    _run("cs_head_parts", rows, 1, (), parts)
    return parts


def q8_0_rows(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows as kernels.BlockRows.from_q8_0 holds them: q (n, k) int8, d (n, k/32) fp16."""
    n, k = len(rows), rows.k
    q, d = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // GROUP, dtype=torch.float16)
    _run("cs_q8_0_rows", rows, 1, (), (q, d))
    return q, d


def q6_k_rows(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows as kernels.split_q6_k splits them: q (n, k) int8, scales (n, k/16) float32."""
    n, k = len(rows), rows.k
    q, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // 16)
    _run("cs_q6_k_rows", rows, 1, (), (q, scales))
    return q, scales


def float_rows(rows: Rows) -> torch.Tensor:
    """The rows' values (n, k) float32, as gguf dequantizes them (files._float)."""
    out = torch.empty(len(rows), rows.k)
    _run("cs_float_rows", rows, 1, (), (out,))
    return out


def q8_0_quantized(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.quantize_q8_0 of the rows' float32 values: q (n, k) int8, d (n, k/32) float32."""
    n, k = len(rows), rows.k
    q, d = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // GROUP)
    _run("cs_q8_0_quantize", rows, 1, (), (q, d))
    return q, d
