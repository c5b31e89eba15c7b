"""The kernel library (csrc/, a plain C ABI): which of its prebuilt variants this CPU runs
(isa.py: chosen once from the CPU's features, never by a timing; CONSTRAINED_SPEC_KERNELS
overrides, "native" builds one for this CPU into the cache), and a thin ctypes binding that
takes and returns torch tensors. ctypes lets the GIL go during each call: the server's HTTP
thread streams replies while the decode thread computes."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os
import re
from ctypes import POINTER, c_char_p, c_double, c_int32, c_int64, c_void_p
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SettingError
from . import isa
from .machine import cache_dir, cpu_name, say

try:
    import fcntl  # Unix: a native build is locked against a second process building it
except ImportError:
    fcntl = None

ENV = "CONSTRAINED_SPEC_KERNELS"
ABI_VERSION = 1  # csrc/abi.h's CS_ABI_VERSION: a library of another is not loaded
INT4, INT4_AMX, BLOCKS = 1, 2, 3  # cs_linear.layout


class _Rows(ctypes.Structure):
    _fields_ = [("values", c_void_p), ("scales", c_void_p), ("count", c_int64), ("d", c_int64),
                ("group", c_int64), ("scale_kind", c_int32)]  # fmt: skip


class _Linear(ctypes.Structure):
    _fields_ = [("tiles", c_void_p), ("scales", c_void_p), ("outputs", c_int64),
                ("inputs", c_int64), ("layout", c_int32), ("bits", c_int32), ("zeros", c_int32),
                ("copies", c_int32)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [("embed", _Rows), ("linears", POINTER(_Linear)), ("norms", POINTER(c_void_p)),
                ("biases", POINTER(c_void_p)), ("qk_norms", POINTER(c_void_p)),
                ("final_norm", c_void_p), ("windows", POINTER(c_int64)),
                ("rotary", POINTER(c_int64)), ("layers", c_int64), ("k_norms", c_int64),
                ("heads", c_int64), ("kv_heads", c_int64), ("head_dim", c_int64),
                ("activation", c_int32), ("eps", c_double), ("embed_scale", c_double),
                ("attention_scale", c_double), ("residual_scale", c_double),
                ("attention_cap", c_double)]  # fmt: skip


_P, _I32, _I64 = c_void_p, c_int32, c_int64
# fmt: off
_SIGNATURES = {  # name: (result, arguments), abi.h's declarations
    "cs_last_error": (c_char_p, []),
    "cs_abi_version": (_I32, []),
    "cs_variant": (c_char_p, []),
    "cs_blocks_isa": (c_char_p, []),
    "cs_avx512_bf16": (_I32, []),
    "cs_amx_bf16": (_I32, []),
    "cs_openmp": (_I32, []),
    "cs_fused_layers": (_I32, [POINTER(_Model), _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _P,
                               _P, _I64, _P, _I32, _I32, _P]),
    "cs_int4_mm": (_I32, [_P, _I64, POINTER(_Linear), _I32, _P]),
    "cs_dense_mm": (_I32, [_P, _I64, _I64, _P, _I64, _I32, _I32, _P]),
    "cs_blocks_mm": (_I32, [_P, _I32, _I64, POINTER(_Linear), _I32, _I32, _P]),
    "cs_q8_head": (_I32, [_P, _I64, POINTER(_Linear), _P, POINTER(_Rows), _P, c_double, _I32, _P]),
    "cs_unpack_bits": (None, [_P, _I64, _I64, _P]),
    "cs_count_legal": (None, [_P, _I64, _I64, _P]),
}
# fmt: on


def _pointers(tensors) -> ctypes.Array:
    return (c_void_p * max(len(tensors), 1))(*(t.data_ptr() for t in tensors))


def _int64s(values) -> ctypes.Array:
    return (c_int64 * max(len(values), 1))(*values)


def _rows(table: torch.Tensor, scales: torch.Tensor) -> _Rows:
    """A table of rows (kernels.table_tensors): float32 (V, d), or int8 with fp16 or float32
    scales (V, d/group)."""
    assert table.dim() == 2 and table.is_contiguous() and scales.is_contiguous()
    if scales.numel() == 0:
        assert table.dtype == torch.float32, table.dtype
        return _Rows(table.data_ptr(), None, table.shape[0], table.shape[1], 0, 0)
    assert table.dtype == torch.int8 and scales.dim() == 2 and scales.shape[0] == table.shape[0]
    kind = {torch.float16: 1, torch.float32: 2}[scales.dtype]
    group = table.shape[1] // scales.shape[1]
    return _Rows(table.data_ptr(), scales.data_ptr(), table.shape[0], table.shape[1], group, kind)


def _linear(tiles: torch.Tensor, scales: torch.Tensor, copies: int = 1) -> _Linear:
    """One of our layouts (kernels.Int4Linear.use_kernel), read from its shapes: int4_mm's tiles
    (N/16, K/8, 16) or AMX's (N/16, K/32, 4, 16) int32, blocks.h's (N/8, K·bits/32, 8)."""
    _check(
        tiles.dtype == torch.int32 and tiles.is_contiguous() and scales.is_contiguous(),
        "tiles: our kernels' int32 tiles (torch's 4-bit pack runs torch's kernel, in Python)",
    )
    _check(scales.dtype == torch.bfloat16, "scales: bf16")
    if tiles.shape[-1] == 8:  # blocks.h: (N/8, K/32, 1 + zeros, 8) scales give K
        _check(tiles.dim() == 3 and scales.dim() == 4, "blocks.h's tiles (N/8, K·bits/32, 8)")
        inputs = 32 * scales.shape[1]
        bits, zeros = tiles.shape[1] * 32 // inputs, scales.shape[2] - 1
        return _Linear(tiles.data_ptr(), scales.data_ptr(), 8 * tiles.shape[0], inputs, BLOCKS,
                       bits, zeros, 1)  # fmt: skip
    amx = tiles.dim() == 4
    _check(tiles.shape[-1] == 16 and (not amx or tiles.shape[2] == 4), "int4_mm's tiles")
    inputs = 32 * tiles.shape[1] if amx else 8 * tiles.shape[1]
    _check(scales.numel() == tiles.shape[0] * inputs, "scales: (N/16, K/32, 2, 16) bf16")
    layout = INT4_AMX if amx else INT4
    return _Linear(tiles.data_ptr(), scales.data_ptr(), 16 * tiles.shape[0], inputs, layout, 0, 0,
                   copies)  # fmt: skip


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


class FusedModel:
    """What the fused layers read of a model, fixed while it lives: the C struct (cs_model) and
    the pointer arrays inside it, built once (llama.CompactLlama.use_layers), holding the
    tensors they point into."""

    def __init__(self, embed, linears, copies, norms, biases, qk_norms, final_norm, shape, block):
        self._args = (embed, linears, copies, norms, biases, qk_norms, final_norm, shape, block)
        self.hidden = final_norm.shape[0]
        layers = len(linears) // 4
        assert layers > 0 and len(linears) == 4 * layers and len(norms) % layers == 0
        for w in (*norms, *biases, *qk_norms, final_norm):
            assert w.dtype == torch.float32 and w.is_contiguous(), "norms, biases: float32"
        self._linears = (_Linear * len(linears))(
            *(_linear(m.packed, m.scale_zero, c) for m, c in zip(linears, copies))
        )
        self._arrays = [_pointers(norms), _pointers(biases), _pointers(qk_norms)]
        norm_p, bias_p, qk_p = self._arrays
        self.struct = _Model(
            _rows(*embed), self._linears, norm_p, bias_p if biases else None,
            qk_p if qk_norms else None, final_norm.data_ptr(), None, None, layers,
            len(norms) // layers, shape.heads, shape.kv_heads, shape.head_dim, 0, shape.eps,
        )  # fmt: skip
        self.pointer = ctypes.pointer(self.struct)
        self.use_block(block)

    def use_block(self, block) -> None:
        """The family's description (families.Block) the layers compute: set again where a
        model's block is replaced (a test moving one part of it)."""
        self.block, self._block_arrays = block, (_int64s(block.windows), _int64s(block.rotary))
        s = self.struct
        s.windows, s.rotary = self._block_arrays
        s.activation, s.embed_scale = block.activation_code, block.embed_scale
        s.attention_scale, s.residual_scale = block.attention_scale, block.residual_scale
        s.attention_cap = block.attention_cap

    def __deepcopy__(self, memo) -> FusedModel:  # a copied model's own tensors, not these
        return FusedModel(*copy.deepcopy(self._args, memo))

    def __reduce__(self):
        return FusedModel, self._args


class Kernels:
    """The loaded library: the callables of the torch extension it replaces, tensors in and out."""

    def __init__(self, path: Path, variant: str, how: str):
        self.path, self.variant, self.how = path, variant, how
        self.lib = lib = ctypes.CDLL(str(path))
        for name, (result, arguments) in _SIGNATURES.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = result, arguments
        if lib.cs_abi_version() != ABI_VERSION:
            raise OSError(f"{path}: ABI {lib.cs_abi_version()}, this binding reads {ABI_VERSION}")

    def _call(self, name: str, *arguments) -> None:
        if getattr(self.lib, name)(*arguments):
            raise RuntimeError(f"{name[3:]}: {self.lib.cs_last_error().decode()}")

    def blocks_isa(self) -> str:
        return self.lib.cs_blocks_isa().decode()

    def avx512_bf16(self) -> bool:
        return bool(self.lib.cs_avx512_bf16())

    def amx_bf16(self) -> bool:
        return bool(self.lib.cs_amx_bf16())

    def openmp(self) -> bool:
        return bool(self.lib.cs_openmp())

    def fused_model(self, *args, **kwargs) -> FusedModel:
        return FusedModel(*args, **kwargs)

    def fused_layers(self, model: FusedModel, block, ids, cos, sin, keys, values, starts, sizes,
                     dense=None, dense_amx=False) -> torch.Tensor:  # fmt: skip
        """The layers of ``model`` as ``block`` (families.Block) describes them for ids (N,)
        int64, rows r taking sizes[r] of them at starts[r].. into their caches keys[r],
        values[r] (llama.CompactCache's); cos, sin (tables, P, hd); dense: the linears' bf16
        copies in AMX tiles for a prompt, else None. Returns the features (N, d) float32."""
        if block is not model.block:
            model.use_block(block)
        assert ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()
        assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape
        for k, v in zip(keys, values):
            assert k.dtype == torch.float32 and v.dtype == torch.bfloat16
            assert k.is_contiguous() and v.is_contiguous() and k.shape[2] * 16 == v.shape[2]
        features = torch.empty(ids.shape[0], model.hidden)
        rows = len(keys)
        copies = _pointers(dense) if dense else None
        self._call(
            "cs_fused_layers", model.pointer, ids.data_ptr(), ids.shape[0], cos.data_ptr(),
            sin.data_ptr(), cos.shape[0], cos.shape[1], _pointers(keys), _pointers(values),
            _int64s([v.shape[2] for v in values]), _int64s(starts), _int64s(sizes), rows,
            copies, int(dense_amx), torch.get_num_threads(), features.data_ptr(),
        )  # fmt: skip
        return features

    def int4_mm(self, x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """x (n, K) bf16 times a 4-bit weight in int4_mm's tiles: (n, N) bf16."""
        _check(x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), "x: (n, K) bf16")
        weight = _linear(tiles, scales)
        _check(weight.layout != BLOCKS and weight.inputs == x.shape[1], "tiles: x's K inputs")
        out = torch.empty(x.shape[0], weight.outputs, dtype=torch.bfloat16)
        threads = torch.get_num_threads()
        self._call("cs_int4_mm", x.data_ptr(), x.shape[0], weight, threads, out.data_ptr())
        return out

    def dense_mm(self, x: torch.Tensor, tiles: torch.Tensor, amx: bool) -> torch.Tensor:
        """x (n, K) bf16 times a bf16 copy in AMX B tiles (N/16, K/32, 16, 32): (n, N) bf16."""
        _check(x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), "x: (n, K) bf16")
        _check(
            tiles.dtype == torch.bfloat16 and tiles.dim() == 4 and tiles.is_contiguous()
            and tiles.shape[1] * 32 == x.shape[1] and tiles.shape[2:] == (16, 32),
            "tiles: (N/16, K/32, 16, 32) bf16",
        )  # fmt: skip
        out = torch.empty(x.shape[0], 16 * tiles.shape[0], dtype=torch.bfloat16)
        self._call(
            "cs_dense_mm", x.data_ptr(), x.shape[0], x.shape[1], tiles.data_ptr(),
            tiles.shape[0], int(amx), torch.get_num_threads(), out.data_ptr(),
        )  # fmt: skip
        return out

    def blocks_mm(self, x, tiles, scales, reference: bool = False) -> torch.Tensor:
        """x (n, K) bf16 or float32, int8 per group, times blocks.h's tiles: (n, N) bf16;
        ``reference``: through the scalar reference (the tests')."""
        _check(
            x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and x.is_contiguous(),
            "x: (n, K) bf16 or float32",
        )
        weight = _linear(tiles, scales)
        _check(weight.layout == BLOCKS and weight.inputs == x.shape[1], "blocks.h's tiles of K")
        out = torch.empty(x.shape[0], weight.outputs, dtype=torch.bfloat16)
        self._call(
            "cs_blocks_mm", x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], weight,
            int(reference), torch.get_num_threads(), out.data_ptr(),
        )  # fmt: skip
        return out

    def q8_head(self, x, packed, scale_zero, terms, weight, weight_scales, legal, roundoff):
        """The Q8_0 LM head's logits (n, V) float32 (kernels.Q8Head), the top ones recomputed in
        float32 from weight's rows; legal (n, V) bool, or empty (every token legal)."""
        _check(x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous(), "x: (n, d) float32")
        rows, blocks = _rows(weight, weight_scales), _linear(packed, scale_zero, 2)
        _check(rows.d == x.shape[1], "weight (V, d)")
        _check(terms.is_contiguous() and terms.shape == (rows.count, 4), "terms (V, 4)")
        masked = legal.numel() > 0
        _check(
            not masked or (legal.dtype == torch.bool and legal.is_contiguous()
                           and legal.shape == (x.shape[0], rows.count)),
            "legal: (n, V) bool",
        )  # fmt: skip
        out = torch.empty(x.shape[0], rows.count)
        self._call(
            "cs_q8_head", x.data_ptr(), x.shape[0], blocks, terms.data_ptr(), rows,
            legal.data_ptr() if masked else None, roundoff, torch.get_num_threads(),
            out.data_ptr(),
        )  # fmt: skip
        return out

    def unpack_bits(self, rows: list[bytes], V: int) -> torch.Tensor:
        """Bitmasks (bytes, bit t of byte t/8: token t) as a (rows, V) bool tensor."""
        for r, row in enumerate(rows):
            if not isinstance(row, bytes) or len(row) * 8 < V:
                raise RuntimeError(
                    f"unpack_bits: row {r} is not a bytes object of at least {(V + 7) // 8} bytes"
                )
        out = torch.empty(len(rows), V, dtype=torch.bool)
        pointers = (c_char_p * max(len(rows), 1))(*rows)
        self.lib.cs_unpack_bits(pointers, len(rows), V, out.data_ptr())
        return out

    def count_legal(self, masks: torch.Tensor) -> list[int]:
        """Each row's number of true entries of (rows, V) bool masks."""
        _check(
            masks.dtype == torch.bool and masks.dim() == 2 and masks.is_contiguous()
            and masks.device.type == "cpu",
            "count_legal: masks must be a contiguous (rows, V) bool tensor on the CPU",
        )  # fmt: skip
        counts = (c_int64 * masks.shape[0])()
        self.lib.cs_count_legal(masks.data_ptr(), masks.shape[0], masks.shape[1], counts)
        return list(counts)


# --- which library ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The library a process runs: its variant, its file, and how it was chosen."""

    variant: str
    path: Path | None
    how: str  # "prebuilt; ...", "built for this CPU, ...", or why none runs


def prebuilt(folder: Path = isa.LIBRARIES) -> dict[str, Path]:
    """The variants this install holds: name → library file."""
    pattern = re.compile(re.escape(isa.PREFIX) + r"(.+)\.(so|dll)$")
    found = (pattern.match(p.name) for p in folder.glob(f"{isa.PREFIX}*"))
    return {m.group(1): folder / m.group(0) for m in found if m}


def choose(setting: str, arch: str, features: frozenset[str], built: dict[str, Path]) -> Choice:
    """The library to load: ``setting`` (CONSTRAINED_SPEC_KERNELS: "" for the CPU's best, a
    variant's name, or "native") on a CPU of ``arch`` with ``features``, among the ``built``
    variants. A variant the CPU lacks, or an unknown name, is a SettingError naming the ones it
    runs; "native" is returned as asked (native() builds it)."""
    runs = [v.name for v in isa.variants(arch) if v.needs <= features and v.name in built]
    if setting == "native":
        return Choice("native", None, "built for this CPU (-march=native)")
    if not setting:
        if not runs:
            why = "no kernel library was built with this install (no C++ compiler then?)"
            return Choice("none", None, why)
        return Choice(runs[-1], built[runs[-1]], f"prebuilt; {ENV} overrides")
    if setting in runs:
        return Choice(setting, built[setting], f"prebuilt, {ENV}={setting}")
    known = {v.name: v for v in isa.variants(arch)}
    if setting in known and setting in built:
        lacks = ", ".join(sorted(known[setting].needs - features))
        why = f"this CPU lacks {lacks}"
    elif setting in known:
        why = "it was not built with this install"
    else:
        why = f"not a variant of {arch}"
    raise SettingError(
        f"{ENV}={setting!r}: {why}. This CPU runs {', '.join(runs) or 'none of the prebuilt'}"
        " (or 'native': built for this CPU, once); unset it for the best of them."
    )


@functools.cache
def load() -> tuple[Kernels | None, str | None]:
    """(the library, None) or (None, why none runs here), once a process; a SettingError for a
    bad CONSTRAINED_SPEC_KERNELS. Where none runs the layers are torch ops (said in one line)."""
    setting = os.environ.get(ENV, "").strip()
    arch = isa.architecture()
    choice = choose(setting, arch, isa.cpu_features(), prebuilt())
    kernels, why = _native(arch) if choice.variant == "native" else _open(choice)
    if kernels is None:
        say(f"{why}: the layers run as torch ops")
    global _loaded
    _loaded = kernels
    return kernels, why


def _open(choice: Choice) -> tuple[Kernels | None, str | None]:
    if choice.path is None:
        return None, choice.how
    try:
        return Kernels(choice.path, choice.variant, choice.how), None
    except (OSError, AttributeError) as err:  # damaged, or another ABI's
        return None, f"the {choice.variant} kernels do not load ({err})"


def loaded() -> Kernels | None:
    """The library where ``load`` has loaded it in this process, else None (never loads)."""
    return _loaded


_loaded = None


def describe() -> str:
    """Which kernels run, for --stats: "x86-64-v4-bf16 (prebuilt; CONSTRAINED_SPEC_KERNELS
    overrides)"."""
    kernels, why = load()
    return f"{kernels.variant} ({kernels.how})" if kernels else f"none ({why})"


# --- CONSTRAINED_SPEC_KERNELS=native: this CPU's own build, into the cache ---------------------------

BUILT, FAILED = "built-from.txt", "failed.txt"


def _native(arch: str) -> tuple[Kernels | None, str | None]:
    """This CPU's own build (a library that does not load is built once more), or, where it
    fails (said once, remembered in the cache so that later processes do not try again), the
    best prebuilt variant."""
    for _ in range(2):
        path, why = native()
        if path is None:
            break
        kernels, why = _open(Choice("native", path, f"built for this CPU, {ENV}=native"))
        if kernels is not None:
            return kernels, None
        (path.parent / BUILT).unlink(missing_ok=True)  # never run: built again
    fallback = choose("", arch, isa.cpu_features(), prebuilt())
    say(f"{ENV}=native: {why}; the prebuilt {fallback.variant} kernels run")
    return _open(Choice(fallback.variant, fallback.path, f"prebuilt; {ENV}=native: {why}"))


def native(cxx: str | None = None) -> tuple[Path | None, str | None]:
    """(the library built for this CPU, None), or (None, why not): compiled once per source,
    compiler and CPU into the cache, a failure remembered there beside it (delete the folder to
    try again)."""
    cxx = cxx or isa.compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX, or install g++ or clang++)"
    stamp = isa.stamp(cxx, isa.NATIVE)
    folder = cache_dir() / "kernels" / re.sub(r"[^A-Za-z0-9.]+", "-", f"{cpu_name()}-{stamp[:16]}")
    library = folder / isa.library_name("native")
    if known := _built_before(folder, stamp):
        return known
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive(folder / "build.lock"):  # a second process waits, then finds the result
            if known := _built_before(folder, stamp):
                return known
            say(f"compiling the kernels for this CPU (-march=native), once, into {folder}")
            why = isa.build(isa.NATIVE, library, cxx)
            (folder / FAILED).unlink(missing_ok=True)
            (folder / BUILT if why is None else folder / FAILED).write_text(f"{stamp}\n{why or ''}")
    except OSError as err:  # a read-only or full cache
        return None, f"the cache cannot hold the build ({err})"
    return (library, None) if why is None else (None, why)


def _built_before(folder: Path, stamp: str):
    """(the library, None) built from ``stamp``, (None, why) where that build failed, or None."""
    library = folder / isa.library_name("native")
    if _read(folder / BUILT).startswith(stamp + "\n") and library.is_file():
        return library, None
    if (failed := _read(folder / FAILED)).startswith(stamp + "\n"):
        return None, f"{failed.split(chr(10), 1)[1]} (remembered: {folder / FAILED})"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, ValueError):  # missing, or not text (UnicodeDecodeError is a ValueError)
        return ""


@contextlib.contextmanager
def _exclusive(path: Path):
    """An flock on ``path`` while the block runs (let go by the kernel if the process dies);
    nothing where the platform or file system has none."""
    with open(path, "w") as lock:
        try:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
