"""Linear layers over GGUF-style blocks, and the measurement that picks their kernel per machine.

Q4_1 (w = d·q + m, q in 0..15, per block of 32 input weights) is exactly torch's int4 weight-only
format with group 32: scale d, zero m + 8d, since torch dequantizes as (q − 8)·scale + zero.
Q8_0 (w = d·q, q int8) and Q6_K (w = d·sc·q per sub-block of 16) are exact in float32: a table of
such rows (the token embedding, the LM head's) keeps its blocks and dequantizes the rows it is
asked for (BlockRows).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import WeightsError
from . import compiled, repack

GROUP = 32
SKINNY_MAX = 32  # up to this many rows, W·xᵀ streams the weight once where x·Wᵀ packs it
# A prompt's prefill (one request's input of this many tokens or more: verify passes feed at most
# 25, and a batch of rows never counts) may run the 4-bit linears' "bf16" prefill kernel: one
# dense matmul over a bf16 copy of the weight (dequantized once, when the kernel is chosen: 100 of
# a 300-token prefill's ~250 ms went to dequantizing per call), where the 4-bit kernel re-reads its
# blocks for every 4 rows (2× faster for 300 rows with avx512_bf16, slower without it: the
# Python layers' prompts run the 4-bit kernel, models.prefill_kernel). "amx-bf16" and "avx512-bf16" multiply the same copy on AMX
# tiles or with AVX-512 BF16 dot products (ours, csrc dense_mm: 1.4-1.5x the 4-bit kernel's
# speed on 128-300 rows without AMX, git show 8fe3c79:docs/measurements.md): a row's outputs do not depend on the
# rows beside it (torch's bf16 matmul changes its sums with the row count), so the fused layers
# run it for every prompt they take, a kept prompt's remainder too, and a prompt reused from the
# cache holds what a fresh one would.
PREFILL_ROWS = 33
PREFILL_KERNELS = ("int4", "bf16", "amx-bf16", "avx512-bf16")
DENSE_KERNELS = ("amx-bf16", "avx512-bf16")  # ours, on the copy in AMX B tiles


# --- blocks -------------------------------------------------------------------------------------


def split_q4_1(raw: torch.Tensor):
    """GGUF Q4_1 rows (N, blocks·20 bytes) → q (N, K) uint8, d and m (N, K/32) float32.
    A block is d (fp16), m (fp16), 16 bytes: element j in the low nibble of byte j, j+16 high."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()  # (N, K/32)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 4:]  # (N, K/32, 16)
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1).reshape(rows, -1)  # (N, K)
    return q, d, m


def quantize_q4_1(w: torch.Tensor):
    """float (N, K) → Q4_1 with llama.cpp's block scales (d = (max − min)/15, m = min, stored in
    fp16), each weight rounded to the nearest value those stored scales represent."""
    blocks = w.float().reshape(w.shape[0], -1, GROUP)  # (N, K/32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).half().float()
    m = low.half().float()
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((blocks - m[..., None]) * inverse[..., None] + 0.5).floor().clamp(0, 15)
    return q.to(torch.uint8).reshape(w.shape), d, m


def dequantize_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    blocks = q.float().reshape(q.shape[0], -1, GROUP)
    return (blocks * d[..., None] + m[..., None]).reshape(q.shape)


def split_q8_0(raw: torch.Tensor):
    """GGUF Q8_0 rows (N, blocks·34 bytes) → q (N, K) int8, d (N, K/32) float32."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
    return q, d


def quantize_q8_0(w: torch.Tensor):
    """float (N, K) → Q8_0 with llama.cpp's block scale (d = max|w|/127, stored in fp16), each
    weight rounded to the nearest value that stored scale represents."""
    blocks = w.float().reshape(w.shape[0], -1, GROUP)
    d = (blocks.abs().amax(-1) / 127).half().float()
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (blocks * inverse[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), d


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    blocks = q.float().reshape(q.shape[0], -1, GROUP)
    return (blocks * d[..., None]).reshape(q.shape)  # exact: |q| ≤ 127 times an fp16 value


def split_q6_k(raw: torch.Tensor):
    """GGUF Q6_K rows (N, blocks·210 bytes) → q (N, K) int8 in [−32, 31] and scales (N, K/16)
    float32, one a sub-block of 16: d·sc, exact (an fp16 d times an int8 sc). A block of 256 is
    ql (128 bytes: low nibbles), qh (64: 2-bit highs), sc (16 int8), d (fp16); element
    128h + 64s + j has ql[64h + j]'s nibble s, and 128h + 32s + j qh[32h + j]'s bits 2s, 2s + 1
    (gguf's dequantize_blocks). A slice of rows at a time (Gemma 2's embedding: 0.6 G values)."""
    rows, width = raw.shape[0], raw.shape[1] // 210 * 256
    q, scales = torch.empty(rows, width, dtype=torch.int8), torch.empty(rows, width // 16)
    nibbles = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    pairs = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    for start in range(0, rows, 4096):
        part = slice(start, min(start + 4096, rows))
        blocks = raw[part].reshape(-1, width // 256, 210)  # (n, K/256, 210)
        n = blocks.shape[0]
        low = (blocks[..., :128].reshape(n, -1, 2, 1, 64) >> nibbles) & 0x0F  # (n, K/256, 2, 2, 64)
        high = (blocks[..., 128:192].reshape(n, -1, 2, 1, 32) >> pairs) & 0x03  # (.., 2, 4, 32)
        q[part] = (low.reshape(n, -1) | (high.reshape(n, -1) << 4)).view(torch.int8) - 32
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (n, K/256, 16)
        d = blocks[..., 208:210].contiguous().view(torch.float16).float()  # (n, K/256, 1)
        scales[part] = (d * sc).reshape(n, -1)
    return q, scales


class BlockRows(nn.Module):
    """A table of rows (V, d) whose values are s·q per group of columns, q int8, kept as its
    blocks: q (V, d) int8 and the scales (V, d/group). Two forms, the group read from the
    scales' shape: Q8_0 (groups of 32, fp16 scales d: 1.06 bytes a value) and Q6_K (sub-blocks of
    16, float32 scales d·sc, q in [−32, 31]: 1.25 bytes a value), where float32 rows take 4
    (Gemma 3's 262,144 × 640 Q8_0 embedding: 178 MB against 671 MB; Gemma 2's 256,000 × 2304
    Q6_K one: 0.74 GB against 2.4). Only the rows asked for are dequantized, to exactly the
    float32 values gguf's dequantization gives (|q| ≤ 127 times an fp16 value, or |q| ≤ 32 times
    an fp16 value times an int8, is exact in float32). Called as an nn.Embedding is: the token
    embedding, and the rows a Q8Head recomputes its top logits from (one table where tied)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        rows, width = q.shape
        assert q.dtype == torch.int8 and scales.dtype in (torch.float16, torch.float32)
        assert scales.shape[0] == rows and width % scales.shape[1] == 0, (q.shape, scales.shape)
        self.register_buffer("q", q.contiguous())  # (V, d)
        self.register_buffer("scales", scales.contiguous())  # (V, d/group)

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor) -> BlockRows:
        """Q8_0's q (V, d) int8 and d (V, d/32), fp16 values (split_q8_0's, quantize_q8_0's)."""
        return cls(q, d.to(torch.float16))

    @property
    def group(self) -> int:  # columns a scale: 32 (Q8_0) or 16 (Q6_K)
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def num_embeddings(self) -> int:  # nn.Embedding's names
        return self.q.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.q.shape[1]

    def forward(self, ids) -> torch.Tensor:
        """The rows ``ids`` (a tensor of any shape, or a slice) → (*ids.shape, d) float32."""
        q, scales = self.q[ids], self.scales[ids]  # (..., d) int8, (..., d/group)
        groups = q.float().unflatten(-1, (-1, self.group))  # (..., d/group, group)
        return (groups * scales.float()[..., None]).flatten(-2)


_NO_SCALES = torch.empty(0, dtype=torch.float16)


def table_tensors(table: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """What csrc/fused_layers.cpp reads of a table of rows (an embedding, the rows a Q8Head
    recomputes from): a BlockRows' q (V, d) int8 and scales (V, d/group) fp16 or float32, or an
    nn.Embedding's float32 rows (V, d) and no scales."""
    if isinstance(table, BlockRows):
        return table.q, table.scales
    return table.weight, _NO_SCALES


# --- layers -------------------------------------------------------------------------------------


class DenseLinear(nn.Module):
    """y = x·Wᵀ in float32, up to 32 rows as W·xᵀ: the CPU BLAS streams W once that way instead
    of packing it, and one row goes as two (its matrix-vector product ran the LM head at a third
    of the speed: 9.5 against 3.3 ms, git show 8fe3c79:docs/measurements.md)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)  # (N, K)

    def forward(self, x: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        n = x.shape[0]
        if n == 1 and x.device.type == "cpu":
            return torch.mm(self.weight, x.repeat(2, 1).T)[:, :1].T
        if n <= SKINNY_MAX and x.device.type == "cpu":
            return torch.mm(self.weight, x.T).T
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids`` (an LM head's: Q8Head.rows)."""
        return self.weight[ids]


class Int4Linear(nn.Module):
    """W = (q − 8)·scale + zero per group of 32 inputs (q in 0..15), run by torch's int4
    weight-only CPU kernel: bf16 activations, scales and outputs, float32 accumulation. (The
    kernel takes float32 too, but ran 8× slower here: git show 8fe3c79:docs/measurements.md.)"""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, copies: int = 1):
        super().__init__()
        n, k = q.shape
        assert k % GROUP == 0, f"int4 groups need inputs in multiples of {GROUP}, got {k}"
        self.copies = copies  # the input is repeated this many times along K (see from_q8_0)
        self.kernel = "torch"  # which of INT4_KERNELS multiplies (use_kernel)
        # q in plain nibble order (re-laid for each kernel, and W = q·scale + (zero − 8·scale)
        # dequantized from them), then torch's pack of them: the kernel's weights
        (nibbles,) = _by_rows(lambda rows, q: (_paired(q.to(torch.uint8)),), n, q)
        self.register_buffer("nibbles", nibbles)  # (N, K/2) uint8
        (packed,) = _by_rows(lambda rows, nibbles: (_torch_pack(_unpaired(nibbles)),), n, nibbles)
        self.register_buffer("packed", packed)  # (N, K/2) uint8
        scale_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1)  # (K/32, N, 2)
        self.register_buffer("scale_zero", scale_zero.to(torch.bfloat16).contiguous())
        self.dense = None  # the bf16 copy the prefill kernel multiplies, where it is chosen
        self.dense_amx = False  # whether ours multiplies it on AMX tiles (else AVX-512 BF16)
        self.register_buffer("scale_rows", scale.to(torch.bfloat16))  # (N, K/32)
        self.register_buffer("offset_rows", (zero - 8 * scale).to(torch.bfloat16))
        self.source = None  # from_rows: the file's rows its weights were laid from

    @classmethod
    def from_rows(cls, rows: repack.Rows, copies: int, kernel: str) -> Int4Linear:
        """A linear laid in ``kernel``'s layout straight from a file's rows (model/repack: the
        same tiles and scales use_kernel lays from the same blocks). The rows stay where they lie
        (``source``): the prompts' bf16 copy and the dequantized weights are computed from them,
        where the torch path keeps per-row scales and offsets (a quarter of the weights' bytes)."""
        assert kernel in INT4_KERNELS and kernel != "torch", kernel
        linear = cls.__new__(cls)
        nn.Module.__init__(linear)
        if kernel in BLOCK_KERNELS:
            packed, scale_zero = repack.blocks(rows, copies)
        else:
            packed, scale_zero = repack.tiles(rows, copies)
            if kernel == "amx-bf16":
                packed = packed.view(packed.shape[0], -1, 4, 16)
        linear.copies, linear.kernel, linear.source = copies, kernel, rows
        for name, value in (("nibbles", None), ("packed", packed), ("scale_zero", scale_zero)):
            linear.register_buffer(name, value)
        linear.register_buffer("scale_rows", None)
        linear.register_buffer("offset_rows", None)
        linear.dense, linear.dense_amx = None, False
        return linear

    @classmethod
    def from_q4_1(cls, q, d, m) -> Int4Linear:
        """Q4_1: w = d·q + m = d·(q − 8) + (m + 8d)."""
        return cls(q, d, m + 8 * d)

    @classmethod
    def from_q8_0(cls, q, d) -> Int4Linear:
        """Q8_0 as two 4-bit halves of u = q + 128 = 16·high + low, the input fed twice:
        d·q = 16d·(high − 8) + d·(low − 8) + 8d. Its 8 bits and block scales survive (bf16
        scales)."""
        assert q.dtype == torch.int8, q.dtype

        def halves(rows, q):  # u = q + 128: two's complement with its sign bit flipped
            u = q.view(torch.uint8) ^ 128
            return (torch.cat((u >> 4, u & 15), 1),)

        zero = torch.zeros_like(d)
        return cls(
            _by_rows(halves, q.shape[0], q)[0],  # (N, 2K) uint8, a vocabulary's head in slices
            torch.cat((16 * d, d), 1),
            torch.cat((zero, 8 * d), 1),
            copies=2,
        )

    def forward(self, x: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """``prefill``: x is a prompt's prefill (never a step, a verify pass or a batch of
        rows), which may take the prefill kernel."""
        x = x.to(torch.bfloat16)
        if self.kernel in BLOCK_KERNELS:  # the input once, whatever the copies (8-bit tiles)
            return (
                fused_library()[0].blocks_mm(x.contiguous(), self.packed, self.scale_zero).float()
            )
        if self.copies > 1 and not (prefill and self.dense is not None):
            x = x.repeat(1, self.copies)  # (n, copies·K)
        if prefill and self.dense is not None:
            if self.dense.dim() == 4:  # AMX tiles (use_prefill)
                dense_mm = fused_library()[0].dense_mm
                return dense_mm(x.contiguous(), self.dense, self.dense_amx).float()
            return F.linear(x, self.dense).float()
        if self.kernel != "torch":
            return fused_library()[0].int4_mm(x.contiguous(), self.packed, self.scale_zero).float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scale_zero
        ).float()

    def use_kernel(self, kernel: str) -> None:
        """Which of INT4_KERNELS multiplies: ``packed`` and ``scale_zero`` are rebuilt from the
        nibbles and scales in that kernel's layout (the same bf16 scales and zeros either way),
        the other layout dropped. The weights are then held once: our kernels' tiles give the
        nibbles back (stored_nibbles), so ``nibbles`` is dropped; torch's pack does not, so
        they stay beside it."""
        assert kernel in INT4_KERNELS, kernel
        if kernel == self.kernel:
            return
        if why := int4_kernel_missing(kernel):
            raise WeightsError(f"the {kernel!r} 4-bit kernel cannot run here: {why}")
        nibbles, n, copies = self.stored_nibbles(), self.out_features, self.copies
        scale, zero = self.scale_and_zero()
        if kernel in BLOCK_KERNELS:  # csrc/blocks.h: 4-bit tiles, or the halves as 8-bit ones
            form = _blocks_form(nibbles, zero, copies)  # the whole weight's, for every slice

            def lay(rows, nibbles, scale, zero):
                return _blocks_pack(_unpaired(nibbles), scale, zero, copies, *form)

            self.packed, self.scale_zero = _by_rows(lay, n, nibbles, scale, zero)
        elif kernel != "torch":  # ours: the tiles' shape names the instructions (csrc int4_mm)
            lay = lambda rows, nibbles, scale, zero: _tile_pack(_unpaired(nibbles), scale, zero)
            self.packed, self.scale_zero = _by_rows(lay, n, nibbles, scale, zero)
            if kernel == "amx-bf16":
                self.packed = self.packed.view(self.packed.shape[0], -1, 4, 16)
        else:
            lay = lambda rows, nibbles: (_torch_pack(_unpaired(nibbles)),)
            (self.packed,) = _by_rows(lay, n, nibbles)
            self.scale_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
        self.nibbles = nibbles if kernel == "torch" else None
        self.kernel = kernel

    def dequantized_nibbles(self) -> torch.Tensor:
        """q (N, copies·K) uint8 in 0..15."""
        return _unpaired(self.stored_nibbles())

    def stored_nibbles(self) -> torch.Tensor:
        """``nibbles``, or where our kernel runs (use_kernel drops them, a prepared model leaves
        them out) a copy rebuilt from its tiles and not kept: only re-laying or dequantizing
        the weights reads them."""
        if self.nibbles is not None:
            return self.nibbles
        n, copies = self.out_features, self.copies
        groups = self.scale_zero.shape[1] * (copies if self.kernel in BLOCK_KERNELS else 1)
        if self.kernel in BLOCK_KERNELS:
            lay = lambda rows, tiles: (_blocks_nibbles(tiles, rows, groups // copies, copies),)
        else:
            lay = lambda rows, tiles: (_tile_nibbles(tiles, rows),)
        return _by_rows(lay, n, self.packed)[0]

    def scale_and_zero(self):
        """The kernels' scale and zero (N, copies·K/32) bf16, w = (q − 8)·scale + zero, read
        from the current kernel's layout."""
        if self.kernel == "torch":
            return self.scale_zero[..., 0].T, self.scale_zero[..., 1].T  # from (K/32, N, 2)
        if self.kernel in BLOCK_KERNELS:  # (N/8, K/32, 1 + zeros, 8)
            tiles, groups, planes = self.scale_zero.shape[:3]
            rows = self.scale_zero.permute(2, 0, 3, 1).reshape(planes, 8 * tiles, groups)
            if self.copies == 1:
                return rows[0], rows[1]
            high = rows[1] if planes == 3 else torch.zeros_like(rows[0])
            return torch.cat((16 * rows[0], rows[0]), 1), torch.cat((high, rows[-1]), 1)
        blocks, groups = self.scale_zero.shape[:2]  # (N/16, K/32, 2, 16)
        both = self.scale_zero.permute(2, 0, 3, 1).reshape(2, 16 * blocks, groups)
        return both[0], both[1]

    @property
    def out_features(self) -> int:  # N, from the layout (_tile_pack's tiles of 16, blocks' of 8)
        if self.kernel == "torch":
            return self.packed.shape[0]
        return self.packed.shape[0] * (8 if self.kernel in BLOCK_KERNELS else 16)

    def use_prefill(self, kernel: str) -> None:
        """The kernel of a prompt's prefill: "bf16" keeps a bf16 copy of the weight (2 bytes
        per weight on top of the blocks' half byte), "amx-bf16" and "avx512-bf16" the same copy
        in AMX B tiles (N/16, K/32, 16, 32) (csrc dense_mm), "int4" drops it."""
        assert kernel in PREFILL_KERNELS, kernel
        if kernel in DENSE_KERNELS and (why := int4_kernel_missing(kernel)):
            raise WeightsError(f"the {kernel!r} prefill kernel cannot run here: {why}")
        self.dense_amx = kernel == "amx-bf16"
        if kernel == "int4":
            self.dense = None
        elif self.source is not None:  # the same values, laid from the file's rows
            self.dense = repack.dense(self.source, self.copies, kernel in DENSE_KERNELS)
        else:
            self.dense = self.dequantized_bf16()
            if kernel in DENSE_KERNELS:  # tile (b, g): k-pair p of inputs 32g.., output 16b + j
                n, k = self.dense.shape
                tiles = self.dense.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
                self.dense = tiles.reshape(n // 16, k // 32, 16, 32).contiguous()

    def dequantized_bf16(self) -> torch.Tensor:
        """The weight (N, K) in bf16: the 4-bit kernel's values up to bf16 rounding (the copies'
        halves summed in float32, then rounded once)."""
        if self.source is not None:
            return repack.dense(self.source, self.copies, tiled=False)
        if self.copies == 1:
            return self.dequantized(torch.bfloat16)
        return sum(self.dequantized().chunk(self.copies, dim=1)).to(torch.bfloat16)

    def dequantized(self, dtype: torch.dtype = torch.float32, rows=slice(None)) -> torch.Tensor:
        """The weight's ``rows`` (n, copies·K) in ``dtype``: q·scale + offset, the offset
        zero − 8·scale rounded to bf16 (the kernels multiply (q − 8)·scale + zero: the same
        where that offset is exact in bf16, as for Q8_0's halves; a 4-bit q times a bf16 scale
        plus a bf16 offset is exact in float32)."""
        if self.source is not None and dtype == torch.float32:
            return repack.dequantized(
                self.source.take(np.arange(self.out_features)[rows]), self.copies
            )
        assert self.source is None, "a linear laid from a file's rows dequantizes in float32"
        nibbles = self.stored_nibbles()[rows]
        scale, offset = self.scale_rows[rows], self.offset_rows[rows]
        n = nibbles.shape[0]
        q = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).view(n, -1, GROUP)
        w = q.to(dtype) * scale[..., None].to(dtype) + offset[..., None].to(dtype)
        return w.view(n, -1)


# Rows re-laid at once (a multiple of every layout's rows a unit: 8, 16, torch's 64): a large
# vocabulary's LM head re-laid whole took GBs of temporaries (int16 and int32 copies of it).
PACK_ROWS = 4096


def _by_rows(lay, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """lay(rows, *slices) → tensors, over PACK_ROWS of a weight's n rows at a time, written
    into outputs allocated once. Every tensor in and out holds the rows in order, a fixed
    number per leading index (1, or a tile's 8 or 16), so a slice of rows is a slice of each."""
    outs = []
    for start in range(0, n, PACK_ROWS):
        stop = min(start + PACK_ROWS, n)
        parts = lay(stop - start, *(t[start * len(t) // n : stop * len(t) // n] for t in tensors))
        if not outs:
            outs = [p.new_empty((n * len(p) // (stop - start), *p.shape[1:])) for p in parts]
        for out, part in zip(outs, parts):
            out[start * len(out) // n : stop * len(out) // n] = part
    return tuple(outs)


def _paired(q: torch.Tensor) -> torch.Tensor:
    """q (n, K) uint8 in 0..15 → nibbles (n, K/2), two inputs a byte, the first in the low half."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpaired(nibbles: torch.Tensor) -> torch.Tensor:
    """_paired's inverse: q (n, K) uint8."""
    return torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).view(nibbles.shape[0], -1)


def _torch_pack(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in 0..15 → torch's int4 pack (N, K/2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 8)


def _tile_pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """q (N, K) in 0..15 and bf16 scale, zero (N, K/32) → our kernel's tiles (N/16, K/8, 16)
    int32 and scales (N/16, K/32, 2, 16) bf16 (csrc/fused_layers.cpp, int4_mm)."""
    n, k = q.shape
    shifts = 4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]  # bit 4m + 16h
    tiles = torch.empty(n // 16, k // 8, 16, dtype=torch.int32)
    for start in range(0, n, 1024):  # in slices: int64 lanes of a whole LM head take ~1 GB
        part = q[start : start + 1024].to(torch.int64)
        part = part.view(-1, 16, k // 8, 4, 2)  # (block, row, 8 inputs, pair m, half h)
        lanes = (part << shifts).sum((-1, -2))  # (blocks, 16, K/8) in 0 .. 2³² − 1
        lanes = torch.where(lanes >= 2**31, lanes - 2**32, lanes).to(torch.int32)
        tiles[start // 16 : (start + 1024) // 16] = lanes.transpose(1, 2)
    scales = torch.stack((scale, zero)).to(torch.bfloat16).view(2, n // 16, 16, k // GROUP)
    return tiles, scales.permute(1, 3, 0, 2).contiguous()


def _blocks_form(nibbles: torch.Tensor, zero: torch.Tensor, copies: int) -> tuple[int, bool]:
    """The bits of csrc/blocks.h's tiles of a whole weight (its nibbles (N, copies·K/2)) and
    whether they keep the high halves' zeros (_blocks_pack): 4 for one copy; for two, 5 where
    every high half is 0 or 1, else 8, the high zeros dropped where all are 0 (Q8_0's)."""
    if copies == 1:
        return 4, True
    high = nibbles[:, : nibbles.shape[1] // 2]  # the high halves, two a byte
    bits = 8 if (high & 0xEE).any() else 5  # a bit above the lowest: a high half over 1
    return bits, bits == 5 or bool(zero[:, : zero.shape[1] // 2].any())


def _blocks_pack(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, copies: int, bits: int, high: bool
):
    """q (N, copies·K) in 0..15 and bf16 scale, zero (N, copies·K/32) → csrc/blocks.h's tiles
    (N/8, K·bits/32, 8) int32 and scales (N/8, K/32, 1 + zeros, 8) bf16, ``bits`` and ``high``
    (whether the high halves' zeros are kept) the whole weight's (_blocks_form). One copy:
    4-bit tiles, the scale and the zero. Two (the halves hi, lo of a wider q, scales 16s and
    s): 5-bit tiles of 16·hi + lo where every hi is 0 or 1 (Q5 blocks), else 8-bit ones of the
    signed byte 16·hi + lo − 128; s and both zeros (the low half's alone where the high halves
    have none, as Q8_0's), so that the weights are the halves' exactly."""
    n, k = q.shape[0], q.shape[1] // copies
    groups = k // GROUP
    if copies == 1:
        planes = (scale, zero)
    else:
        assert copies == 2, copies
        if not torch.equal(scale[:, :groups], 16 * scale[:, groups:]):
            raise WeightsError("8-bit tiles need the high half's scales at 16× the low half's")
        q = 16 * q[:, :k].to(torch.int16) + q[:, k:]
        planes = (scale[:, groups:], zero[:, :groups], zero[:, groups:])
        if not high:  # Q8_0's: its high halves have no zero
            planes = (planes[0], planes[2])
    if bits == 8:  # vector c of a group: inputs 4c..4c+3, a byte each
        vectors = (q - 128).to(torch.int8).view(n // 8, 8, groups, 8, 4)
    else:  # vector c: inputs 8c..8c+3 in the low nibbles, 8c+4.. in the high ones; then the bits
        q = q.to(torch.uint8).view(n // 8, 8, groups, 4, 2, 4)  # (tile, lane, group, c, half, j)
        vectors = (q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)
        if bits == 5:  # bit v = 2c + half of byte j: unpacked vector v's fifth bit
            fifth = (q >> 4).permute(0, 1, 2, 5, 3, 4).reshape(n // 8, 8, groups, 4, 8)
            plane = (fifth << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
            vectors = torch.cat((vectors, plane[:, :, :, None]), 3)
    tiles = vectors.permute(0, 2, 3, 1, 4).contiguous().view(torch.int32)  # (tile, group, c, lane)
    scales = torch.stack(planes).to(torch.bfloat16).view(len(planes), n // 8, 8, groups)
    return tiles.reshape(n // 8, -1, 8), scales.permute(1, 3, 0, 2).contiguous()


def _blocks_nibbles(tiles: torch.Tensor, n: int, groups: int, copies: int) -> torch.Tensor:
    """_blocks_pack's inverse for the weights of an (n, K) q, K = 32·groups: nibbles
    (n, copies·K/2) uint8 (Int4Linear's)."""
    vectors = tiles.reshape(n // 8, groups, -1, 8).view(torch.uint8)  # (tile, group, c, lane·4)
    vectors = vectors.view(n // 8, groups, -1, 8, 4).permute(0, 3, 1, 2, 4)  # (tile, lane, g, c, j)
    if vectors.shape[3] == 8:  # 8-bit
        q = vectors.reshape(n, -1).view(torch.int8).to(torch.int16) + 128
    else:
        nibbles = vectors[:, :, :, :4]
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=-2)  # (tile, lane, g, c, half, j)
        if vectors.shape[3] == 5:
            plane = vectors[:, :, :, 4]  # (tile, lane, g, j): bit 2c + half
            bits = (plane[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1  # (…, j, v)
            q = q | (bits.view(*bits.shape[:-1], 4, 2).permute(0, 1, 2, 4, 5, 3) << 4)
        q = q.reshape(n, -1).to(torch.int16)
    if copies == 2:
        q = torch.cat((q >> 4, q & 15), 1)
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize_int8(x: torch.Tensor):
    """csrc/blocks.h's activations: x (n, K) in groups of 32 → q (n, K) int8 in −127..127 and
    d (n, K/32) float32, x ≈ d·q: d = max|x|/127, q = x·(127/max|x|) rounded, ties to even."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    top = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    q = torch.round(groups * inverse).to(torch.int8).reshape(x.shape)
    return q, (top / 127).squeeze(-1)


def _tile_nibbles(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """_tile_pack's inverse for the weights: its tiles (any view of them) of an (n, K) q →
    nibbles (n, K/2) uint8, two inputs a byte, the first in the low half (Int4Linear's)."""
    tiles = tiles.reshape(n // 16, -1, 16)
    k = 8 * tiles.shape[1]
    shifts = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]).view(1, 1, 1, 4, 2)
    nibbles = torch.empty(n, k // 2, dtype=torch.uint8)
    for start in range(0, n, 1024):  # in slices, as _tile_pack
        lanes = tiles[start // 16 : (start + 1024) // 16].transpose(1, 2).to(torch.int64)
        q = ((lanes & 0xFFFFFFFF)[..., None, None] >> shifts) & 15  # (blocks, 16, K/8, 4, 2)
        q = q.reshape(-1, k)
        nibbles[start : start + q.shape[0]] = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return nibbles


# The 4-bit matmul of a model's linears (steps, verify passes, batch rows, and prompts through
# the "int4" prefill kernel): "avx512-bf16" (ours, csrc/fused_layers.cpp: AVX-512 BF16 dot
# products over the weights repacked for them; CPUs with avx512_bf16, where torch's kernel runs
# at 21–24 GB/s a core, compute-bound), "amx-bf16" (ours on the same tiles, through AMX tile
# multiplies: 32 rows for one unpacking of the weights, where a pass of many rows is
# compute-bound; CPUs with amx_bf16) or "torch" (torch's int4 weight-only kernel). All multiply
# the same bf16 inputs by the same weights, sum in float32 and round once to bf16; they sum in
# different orders (one bf16 ulp apart on ~0.1% of outputs). One of them runs for a model's
# whole life (models.use_kernels: the first of models.MATMUL_ORDER this CPU runs), so the
# baseline and speculation compute the same function.
# "avx2", "neon" and "scalar" (ours, csrc/blocks.h: the activations quantized to int8 per group
# of 32, as llama.cpp's are, integer dot products over the weights' own 4-bit or 8-bit values:
# vpmaddubsw on x86 CPUs with AVX2 and FMA, sdot on ARM CPUs with dot products, plain C++ in the
# baseline variant) multiply another function, the same bits on every one of them: x rounded to
# int8 groups rather than bf16, then exact integer sums and float32 scales. The kernel library
# (compiled.py) runs all but "torch", which runs the Python layers only.
INT4_KERNELS = ("avx512-bf16", "amx-bf16", "avx2", "neon", "scalar", "torch")
BLOCK_KERNELS = ("avx2", "neon", "scalar")


def int4_kernel_missing(kernel: str) -> str | None:
    """Why ``kernel`` (one of INT4_KERNELS) cannot run here, or None if it can. (Every 4-bit
    linear is built through torch's pack, so both need torch's int4 ops.)"""
    if kernel == "torch" or int4_missing():
        return int4_missing()
    module, why = fused_library()
    if module is None:
        return f"it is in the kernel library, which does not run here ({why})"
    if kernel in BLOCK_KERNELS:
        if module.blocks_isa() != kernel:  # (the scalar reference: a baseline variant's)
            need = {"avx2": "AVX2 and FMA", "neon": "NEON dot products (ARMv8.2 dotprod)"}
            why = f"no {need[kernel]}" if kernel in need else "faster blocks.h kernels"
            return (
                f"this CPU or build has {why} (the {module.variant} kernels: {module.blocks_isa()})"
            )
        return None
    if not module.avx512_bf16():
        return "this CPU has no AVX-512 BF16 instructions (avx512_bf16)"
    if kernel == "amx-bf16" and not module.amx_bf16():
        return "this CPU has no AMX BF16 tiles (amx_bf16), or the kernel did not grant them"
    return None


BF16_ROUNDOFF = 2.0**-8  # unit roundoff of bf16 (8 significant bits)
HEAD_ROUNDOFF = BF16_ROUNDOFF / (1 - BF16_ROUNDOFF)  # the head's bf16 outputs: |a − ã| ≤ this·|ã|


_EVERY_TOKEN = torch.empty(0, dtype=torch.bool)  # q8_head's "no mask"


class Q8Head(nn.Module):
    """The LM head over Q8_0 blocks (w = d·q per block of 32 weights, q int8): every logit from
    the blocks through a 4-bit kernel (two 4-bit halves, bf16 scales and inputs: 35 MB read
    where float32 streams 113 MB), each with a bound on its distance from the float32 logit;
    the logits that could be the largest legal one are then recomputed in float32 from their
    rows. So the largest legal logit and its token are the float32 head's (greedy picks what a
    float32 head picks) and every other logit is within its bound. A position's logits depend
    on its own input and mask only (the kernel's rows are independent), so a step, a verify
    pass and a batch row compute the same.

    Either kernel returns bf16 of a float32 sum of x̃·w̃ (x̃ = bf16(x), denormals flushed to 0 as
    our kernel's instructions do; w̃ = d̃·q with d̃ the bf16 scale). Per position x and token t,
    |approx − x·w_t| ≤ ‖x‖·slack_t + ‖x − x̃‖·‖w̃_t‖ + u/(1−u)·|approx| + the sum's rounding:
    torch's kernel (products exact, checked against float64) sums 2K products,
    ≤ 2γ·‖|hi_t| + |lo_t|‖·‖x‖ with γ = 2K·2⁻²⁴ (in slack_t, with ‖w̃_t − w_t‖); ours
    sums (128 + q)·x̃ and Σx̃ per group and combines them, ≤ Σ_g S_g·c_{t,g} ≤ ‖S‖·‖c_t‖
    (Cauchy–Schwarz), S_g = Σ|x̃| over group g: a vector per token rather than a (K/32, V) matrix
    read every step (7 MB; the term is ~0.01 of a logit, the others ~0.25 each, and the looser
    form left as many logits to recompute: 1.39 a position against 1.38 on real features). u: the
    bf16 roundoff. The terms are one (n, 4) × (4, V) product (``terms``). Tests check the bound
    on random and real features, on both kernels."""

    def __init__(self, weight: torch.Tensor | BlockRows):
        """``weight`` (V, d): a BlockRows (a file's Q8_0 blocks: the screen's blocks too; its
        Q6_K blocks: the screen then runs on their Q8_0 rounding), or float32 rows, kept as a
        BlockRows where they are Q8_0 values (the blocks quantized from them give them back
        exactly), else as they are (F16's: the screen on their Q8_0 rounding)."""
        super().__init__()
        vocab, k = weight.shape
        q8_0 = isinstance(weight, BlockRows) and weight.scales.dtype == torch.float16
        if q8_0 and weight.group == GROUP and vocab % 16 == 0:
            blocks = weight.q, weight.scales.float()
        else:  # quantized from the rows, padded: the kernel packs 16 rows at once
            blocks = _padded_q8_0(weight, vocab + -vocab % 16)
            if not isinstance(weight, BlockRows):
                values = weight.float()
                q, d = blocks[0][:vocab].clone(), blocks[1][:vocab]  # q: not a view of the pad
                if torch.equal(dequantize_q8_0(q, d), values):
                    weight = BlockRows.from_q8_0(q, d)
                else:  # the caller's storage (a tied embedding's too)
                    weight = nn.Embedding.from_pretrained(values.contiguous())
                del values
        self.table = weight  # the rows recomputed in float32: a BlockRows, or an nn.Embedding's
        self.blocks = Int4Linear.from_q8_0(*blocks)
        del blocks  # padded ones: their own copy (a 256k vocabulary's: 0.6 GB)
        self.register_buffer("terms", self._bound_terms())
        self.fused = True  # one call of the kernel library (csrc q8_head) where it runs

    @classmethod
    def from_rows(
        cls, table: BlockRows | nn.Embedding, rows: repack.Rows, kernel: str, terms=None
    ) -> Q8Head:
        """The head over ``table`` (its float32 rows), its blocks laid in ``kernel``'s layout
        straight from a file's ``rows`` (Int4Linear.from_rows: the head's rows, re-quantized to
        Q8_0 where __init__ quantizes them, padded with zero rows to a multiple of 16), its bound
        ``terms`` those stored for the same file and kernel, or computed as __init__ and
        use_kernel compute them."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.table, head.fused = table, True
        head.blocks = Int4Linear.from_rows(rows, 2, kernel)
        if terms is None:
            terms = head._bound_terms()
            terms[:, 2:] = head._kernel_terms(kernel)
        head.register_buffer("terms", terms)
        return head

    def _bound_terms(self) -> torch.Tensor:
        """The bound's terms per token (V, 4), times (‖x‖, ‖x − x̃‖, ‖S‖, 1) per position:
        slack_t, ‖w̃_t‖, and while our kernel runs ‖c_t‖ and a floor for flushed intermediates
        (0 here: _kernel_terms). A slice of rows at a time: the whole would take ~1 GB at once."""
        vocab, k = self.table.num_embeddings, self.table.embedding_dim
        gamma, slack, norms = 2 * k * 2.0**-24, [], []
        source = self.blocks.source  # laid from a file's rows: the same values, computed there
        buffers = (
            tuple(torch.empty(min(vocab, 4096), k) for _ in range(3)) if source is not None else ()
        )
        for start in range(0, vocab, 4096):
            rows = slice(start, min(start + 4096, vocab))
            if source is not None:
                taken = source.take(np.arange(rows.start, rows.stop))
                w, spread, error = repack.head_parts(taken, buffers)
                spread = spread.norm(dim=1)
            else:
                hi, lo = self.blocks.dequantized(rows=rows).chunk(2, dim=1)  # what the kernel uses
                w, spread = hi + lo, (hi.abs() + lo.abs()).norm(dim=1)
                error = w - self.rows(torch.arange(rows.start, rows.stop))  # the float32 rows'
            norms.append(w.norm(dim=1))
            slack.append(error.norm(dim=1) + 2 * gamma * spread)
        zero = torch.zeros(vocab)
        return torch.stack([torch.cat(slack), torch.cat(norms), zero, zero], 1).contiguous()

    def _kernel_terms(self, kernel: str) -> torch.Tensor:
        """The terms (V, 2) of ``kernel``'s own rounding: ‖c_t‖ and the floor (ours), else 0."""
        if kernel == "torch":
            return torch.zeros(self.out_features, 2)
        error = _blocks_group_error if kernel in BLOCK_KERNELS else _group_error
        norms = error(self.blocks)[:, : self.out_features].norm(dim=0)  # blocks: padded rows
        return torch.stack((norms, torch.full_like(norms, 2.0**-100)), 1)

    @property
    def out_features(self) -> int:  # nn.Linear's name: the logits' width
        return self.table.num_embeddings

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The head's float32 rows ``ids`` (n, d), dequantized where it keeps blocks."""
        return self.table(ids)

    def dequantized(self) -> torch.Tensor:
        """Every row (V, d) in float32: the table's own where it keeps float32 rows."""
        if isinstance(self.table, nn.Embedding):
            return self.table.weight.data
        return self.table(slice(None))

    def use_kernel(self, kernel: str) -> None:
        """Which of INT4_KERNELS runs the blocks; the bound follows it. The terms always match
        the blocks' kernel (torch's zeros from __init__ on), so the same kernel again keeps
        them: a prepared model's head stores them (recomputing Gemma 3's 262k: 0.15 s a load)."""
        if kernel == self.blocks.kernel:
            return
        self.blocks.use_kernel(kernel)
        self.terms[:, 2:] = self._kernel_terms(kernel)

    def approximate(self, x: torch.Tensor):
        """The kernel's logits of x (n, d), (n, V) float32 holding bf16 values, and how far
        each may be from float32's."""
        if self.blocks.kernel in BLOCK_KERNELS:  # x̃: int8 groups, the input fed once
            q, d = quantize_int8(x)
            rounded = (q.float().view(x.shape[0], -1, GROUP) * d[..., None]).view(x.shape)
            blocks = self.blocks
            approx = fused_library()[0].blocks_mm(
                x.float().contiguous(), blocks.packed, blocks.scale_zero
            )
            approx = approx.float()[:, : self.out_features]
        else:  # bf16 with denormals flushed (DAZ), fed twice
            rounded = x.to(torch.bfloat16)
            rounded = rounded.masked_fill(rounded.abs() < 2.0**-126, 0).float()
            approx = self.blocks(rounded)[:, : self.out_features]
        sums = rounded.abs().view(x.shape[0], -1, GROUP).sum(-1)  # (n, K/32): S_g
        scales = torch.stack(
            [x.norm(dim=1), (x - rounded).norm(dim=1), sums.norm(dim=1), x.new_ones(x.shape[0])], 1
        )
        return approx, torch.addmm(approx.abs(), scales, self.terms.T, beta=HEAD_ROUNDOFF)

    def forward(self, x: torch.Tensor, legal: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (n, V) of x (n, d); ``legal`` (n, V) bool limits the float32 recomputation to
        the tokens that could be the largest legal logit (all tokens when None). One call of the
        kernel library where it runs and the blocks are ours (~30 small torch ops, 0.3 ms of a 3.7 ms step, else:
        git show 8fe3c79:docs/measurements.md); both compute the same up to the bound's float rounding."""
        ours = self.blocks.kernel != "torch"  # (the library cannot call torch's)
        module = fused_library()[0] if self.fused and ours and x.device.type == "cpu" else None
        if module is not None:
            legal = _EVERY_TOKEN if legal is None else legal.contiguous()
            blocks = self.blocks
            return module.q8_head(
                x.float().contiguous(),
                blocks.packed,
                blocks.scale_zero,
                self.terms,
                *table_tensors(self.table),
                legal,
                HEAD_ROUNDOFF,
            )
        approx, bound = self.approximate(x)
        low = approx - bound
        if legal is not None:
            low.masked_fill_(~legal, float("-inf"))
        maybe = bound.add_(approx) >= low.amax(dim=1, keepdim=True)  # (n, V)
        if legal is not None:
            maybe &= legal
        for i, row in enumerate(maybe):
            ids = row.nonzero().squeeze(1)
            approx[i, ids] = self.rows(ids) @ x[i]
        return approx


def _padded_q8_0(table: torch.Tensor | BlockRows, rows: int):
    """Q8_0 blocks of a table's rows (V, d), zero rows after them up to ``rows``: q (rows, d)
    int8, d (rows, d/32) float32. A slice at a time: Gemma 2's 256,000 × 2304 table is 2.4 GB
    in float32."""
    vocab, k = table.shape
    q, d = torch.zeros(rows, k, dtype=torch.int8), torch.zeros(rows, k // GROUP)
    for start in range(0, vocab, 4096):
        part = slice(start, min(start + 4096, vocab))
        values = table(part) if isinstance(table, BlockRows) else table[part].float()
        q[part], d[part] = quantize_q8_0(values)
    return q, d


def _blocks_group_error(blocks: Int4Linear) -> torch.Tensor:
    """_group_error for csrc/blocks.h's 8-bit tiles: per group, the exact integer A = Σ(q − 8)·q̃
    (|q − 8| ≤ 136) and Σq̃, then three rounded products (s·d, d·Σq̃ and the two zeros' fma's
    operands) and three fused multiply-adds a group over G groups: ≤ γ(3G + 1)·Σ_g (|s_g|·|A|·d
    + (|z_hi| + |z_lo|)·|Σq̃|·d), and d·Σ|q̃| = S_g. So c_{t,g} = γ(3G + 1)·(136|s| + |z_hi| +
    |z_lo|), 1% on top for the second-order terms."""
    u = 2.0**-24
    scale, zero = (t.float().abs() for t in blocks.scale_and_zero())  # the halves: (V, 2G)
    groups = scale.shape[1] // 2
    gamma = (3 * groups + 1) * u / (1 - (3 * groups + 1) * u)
    coef = 1.01 * gamma * (136 * scale[:, groups:] + zero[:, :groups] + zero[:, groups:])
    return coef.T.contiguous()


def _group_error(blocks: Int4Linear) -> torch.Tensor:
    """Our kernel's float32 error on a Q8_0 head's halves, per unit of S_g = Σ|x̃| over input
    group g: (K/32, V) c_{t,g} = A·(|s_hi| + |s_lo|) + B·(|z_hi| + |z_lo|), from its sums
    (csrc int4_mm): a = Σ(128 + q)·x̃, |q| ≤ 15, ≤ γ(c)·143·S_g with c roundings a sum: 10 in
    4 chains of 4 dot-product instructions (≤ 2 roundings each) and 2 adds (avx512-bf16), 32
    in one chain of 32 products (amx-bf16); X = Σx̃ in order: ≤ γ(31)·S_g; t = a − 136·X
    rounded once, |t| ≤ 8·S_g; the total, 2 fused multiply-adds a group over G groups:
    ≤ γ(2G)·Σ_g (|s_g|·|t| + |z_g|·|X|). So A = 143γ(c) + 136γ(31) + 8u + 8γ(2G) and
    B = γ(31) + γ(2G), u = 2⁻²⁴, γ(n) = nu/(1 − nu); 1% on top for the second-order terms."""
    u = 2.0**-24
    gamma = lambda n: n * u / (1 - n * u)
    scale, zero = (t.float().abs() for t in blocks.scale_and_zero())  # (V, 2K/32) each
    groups, roundings = scale.shape[1], 32 if blocks.kernel == "amx-bf16" else 10
    a = 1.01 * (143 * gamma(roundings) + 136 * gamma(31) + 8 * u + 8 * gamma(2 * groups))
    b = 1.01 * (gamma(31) + gamma(2 * groups))
    hi, lo = groups // 2, slice(groups // 2, None)  # the input is fed twice (copies = 2)
    coef = a * (scale[:, :hi] + scale[:, lo]) + b * (zero[:, :hi] + zero[:, lo])
    return coef.T.contiguous()


@functools.cache
def int4_missing() -> str | None:
    """Why this torch build cannot run the 4-bit kernel on this machine, or None if it can (its
    CPU int4 ops are missing from some builds and architectures)."""
    try:
        linear = Int4Linear.from_q4_1(*quantize_q4_1(torch.randn(64, 64)))
        linear(torch.randn(1, 64))
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return None


HEAD_KERNELS = ("q8", "float")


def best_ms(call, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


# --- the fused layers (csrc/fused_layers.cpp, through compiled.py) ---------------------------------

# How the compact forward runs its layers for a step, a verify pass or a batch's rows: "fused"
# (one call of our kernel library for every layer, on our 4-bit kernels) or "python" (llama.py's
# loop of torch ops: where no library runs here, and with torch's 4-bit kernel, which the
# library cannot call). Prompts take the same way (the Python loop: one masked attention call
# per layer), on the prefill kernel.
LAYER_KERNELS = ("fused", "python")


def fused_library():
    """(the kernel library, None) or (None, why none runs here): the prebuilt variant this CPU
    runs (compiled.load), loaded once a process."""
    return compiled.load()


def fused_if_built():
    """The kernel library where it is already loaded in this process, else None (never loads:
    a caller that only compiles constraints should not wait for it)."""
    return compiled.loaded()


def fused_missing() -> str | None:
    """Why the fused layers cannot run here, or None if they can."""
    return compiled.load()[1]


def describe_library() -> str:
    """Which kernel library runs, for --stats: "x86-64-v4-bf16 (prebuilt; ... overrides)"."""
    return compiled.describe()


def library_key() -> str:
    """The library's variant, part of the key of every measurement of our kernels ("none"
    where none runs): a variant forced by CONSTRAINED_SPEC_KERNELS measures its own."""
    library = fused_library()[0]
    return library.variant if library is not None else "none"
