"""A GGUF file's header read in one pass: its metadata and its tensor table, the tensors' blocks
left where they lie (memory-mapped). gguf-py's GGUFReader builds a few numpy arrays for every
item of every array (a 150k vocabulary's tokens and merges: ~10 s); this reads an array of
numbers as one numpy array and an array of strings as a list of bytes (~0.1 s).

``GGUFHeader`` offers what the package and transformers' GGUF loading read off a GGUFReader:
``fields`` (gguf's ReaderField: ``contents()``, and ``parts[data[i]]`` for item i, built when
asked), ``tensors`` (gguf's ReaderTensor, ``data`` a view of the mapped file shaped as
GGUFReader shapes it), ``alignment`` and ``data_offset``; and ``value(key)``, the decoded value
(numpy arrays for arrays of numbers). Tests compare it with GGUFReader field by field and tensor by
tensor.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
VERSIONS = (2, 3)
ALIGNMENT = 32  # general.alignment's default
# the value types of fixed size: their numpy type
SCALARS = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}
# tensors GGUFReader shapes in their own numpy type (the others: their bytes, per row)
PLAIN = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class HeaderError(ValueError):
    """What is wrong with a file's header; ``tensor`` names the tensor where one is at fault."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class _Items(Sequence):
    """An array field's items as GGUFReader's parts (item i at index i): a string as a
    memoryview of its bytes, a number as a one-item numpy array."""

    def __init__(self, values):
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i):
        if isinstance(self._values, np.ndarray):
            return self._values[i : i + 1] if isinstance(i, int) else self._values[i]
        return memoryview(self._values[i]) if isinstance(i, int) else self._values[i]


class GGUFHeader:
    """The header of the GGUF file at ``path`` (HeaderError where it is not one, or truncated)."""

    def __init__(self, path: str | Path, state: dict | None = None):
        """``state``: what state() kept of this file's header (then not read again)."""
        self.path = Path(path)
        with open(self.path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._map, np.uint8)  # the whole file, mapped read-only
        self._values: dict = {}
        self.fields: dict[str, ReaderField] = {}
        infos = self._read() if state is None else self._restore(state)
        alignment = self.value("general.alignment", ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment {alignment} is not a power of two")
        self.alignment = int(alignment)
        self.tensors = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise HeaderError("two tensors share a name")

    def _read(self) -> list[tuple]:
        """The metadata into ``fields``, the data's start; the tensor table's entries."""
        cursor = _Cursor(self.data)
        if len(self.data) < 24 or cursor.unpack("<I") != MAGIC:
            raise HeaderError("GGUF magic invalid")
        version = cursor.unpack("<I")
        if version not in VERSIONS:
            raise HeaderError(f"GGUF version {version} is not one this reads ({VERSIONS})")
        tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
        self._add("GGUF.version", np.array([version], np.uint32), GGUFValueType.UINT32)
        self._add("GGUF.tensor_count", np.array([tensor_count], np.uint64), GGUFValueType.UINT64)
        self._add("GGUF.kv_count", np.array([kv_count], np.uint64), GGUFValueType.UINT64)
        for _ in range(kv_count):
            key = cursor.string().decode("utf-8")
            if key in self.fields:
                raise HeaderError(f"duplicate metadata key {key}")
            self._add(key, *cursor.value(cursor.unpack("<I")))
        infos = [cursor.tensor_info() for _ in range(tensor_count)]
        alignment = self.value("general.alignment", ALIGNMENT)
        self.data_offset = cursor.at + -cursor.at % max(int(alignment), 1)
        return infos

    def state(self) -> dict:
        """What a later load needs of this header, as JSON values: the scalar metadata (no
        arrays: a vocabulary is the tokenizer's, stored as such), the tensor table, the data's
        start."""
        scalars = {
            key: [int(field.types[0]), self.value(key)]
            for key, field in self.fields.items()
            if len(field.types) == 1
        }
        tensors = [
            [t.name, int(t.tensor_type), t.shape.tolist(), t.data_offset - self.data_offset]
            for t in self.tensors
        ]
        return {"scalars": scalars, "tensors": tensors, "data_offset": self.data_offset}

    def _restore(self, state: dict) -> list[tuple]:
        for key, (kind, value) in state["scalars"].items():
            kind = GGUFValueType(kind)
            if kind == GGUFValueType.STRING:
                self._add(key, value.encode("utf-8"), kind)
            else:
                self._add(key, np.array([value], SCALARS[kind]), kind)
        self.data_offset = int(state["data_offset"])
        return [(n, np.array(dims, np.uint64), kind, at) for n, kind, dims, at in state["tensors"]]

    def _add(self, key: str, value, kind, item=None) -> None:
        """A field as GGUFReader has it: parts[data[i]] the i-th item, types [kind] or
        [ARRAY, item kind]."""
        self._values[key] = value
        if kind == GGUFValueType.ARRAY:
            field = ReaderField(0, key, _Items(value), range(len(value)), [kind, item])
        elif kind == GGUFValueType.STRING:
            field = ReaderField(0, key, [memoryview(value)], [0], [kind])
        else:
            field = ReaderField(0, key, [value], [0], [kind])
        self.fields[key] = field

    def release(self, tensors) -> None:
        """Drop the pages of ``tensors``' bytes from this process's resident memory (their
        values are laid elsewhere now: a load that touched every tensor's pages would hold
        the whole file on top of its own copy); the system keeps them cached for the next
        load. Nothing where the system has no madvise (Windows)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        for tensor in tensors:
            start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
            self._map.madvise(
                mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start
            )

    def value(self, key: str, default=None):
        """A metadata value: a number, a str, a numpy array (an array of numbers) or a list of
        str (an array of strings); ``default`` where the file has no such key."""
        if key not in self._values:
            return default
        value = self._values[key]
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if isinstance(value, list):
            return [v.decode("utf-8") for v in value]
        if (
            isinstance(value, np.ndarray)
            and key in self.fields
            and len(self.fields[key].types) == 1
        ):
            return value[0].item()
        return value

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offset: int) -> ReaderTensor:
        try:
            kind = GGMLQuantizationType(raw_type)
            block, size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise HeaderError(f"tensor {name} has an unknown type {raw_type}", name) from None
        elements = int(np.prod(dims, dtype=np.uint64)) if len(dims) else 1
        if elements % block or (len(dims) and dims[0] % block):
            raise HeaderError(f"tensor {name}: {dims.tolist()} is no whole number of blocks", name)
        start, nbytes = self.data_offset + offset, elements // block * size
        if start + nbytes > len(self.data):
            raise HeaderError(
                f"tensor {name} ends at byte {start + nbytes}, past the file's end "
                f"({len(self.data)} bytes): the file is truncated",
                name,
            )
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        if kind in PLAIN:
            data = self.data[start : start + nbytes].view(PLAIN[kind]).reshape(shape)
        else:
            rows = shape[:-1] + (shape[-1] // block * size,)
            data = self.data[start : start + nbytes].reshape(rows)
        return ReaderTensor(name, kind, dims, elements, nbytes, start, data, None)


class _Cursor:
    """Reads a header's values from ``data`` (the mapped file) at ``at``, moving past them."""

    def __init__(self, data: np.ndarray):
        self.data, self.at = data, 0
        self.raw = memoryview(data)

    def unpack(self, code: str):
        try:
            (value,) = struct.unpack_from(code, self.raw, self.at)
        except struct.error:
            raise HeaderError(f"the header ends early, at byte {self.at}") from None
        self.at += struct.calcsize(code)
        return value

    def string(self) -> bytes:
        n = self.unpack("<Q")
        if self.at + n > len(self.data):
            raise HeaderError(f"a string at byte {self.at} runs past the file's end")
        value = bytes(self.raw[self.at : self.at + n])
        self.at += n
        return value

    def value(self, raw_kind: int):
        """(value, kind[, item kind]) of a metadata value of type ``raw_kind``."""
        try:
            kind = GGUFValueType(raw_kind)
        except ValueError:
            raise HeaderError(f"unknown metadata type {raw_kind} at byte {self.at}") from None
        if kind == GGUFValueType.STRING:
            return self.string(), kind
        if kind in SCALARS:
            return self.array(SCALARS[kind], 1), kind
        if kind != GGUFValueType.ARRAY:
            raise HeaderError(f"unknown metadata type {raw_kind} at byte {self.at}")
        item, count = GGUFValueType(self.unpack("<I")), self.unpack("<Q")
        if item == GGUFValueType.STRING:
            return [self.string() for _ in range(count)], kind, item
        if item not in SCALARS:
            raise HeaderError(f"an array of {item.name} at byte {self.at} is not read here")
        return self.array(SCALARS[item], count), kind, item

    def array(self, dtype, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.at + size > len(self.data):
            raise HeaderError(f"an array at byte {self.at} runs past the file's end")
        values = np.frombuffer(self.raw, dtype, count, self.at)
        self.at += size
        return values

    def tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = self.string().decode("utf-8")
        dims = self.array(np.uint64, self.unpack("<I")).copy()
        return name, dims, self.unpack("<I"), self.unpack("<Q")
