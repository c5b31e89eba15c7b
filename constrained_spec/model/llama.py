"""A compact Llama forward (in the style of gpt-fast) over weights kept as they ship: the fast target.

The built-in model ships as a GGUF of 210 Q4_1 tensors (w = d·q + m per block of 32 weights, d and
m in fp16) and one Q8_0 token embedding (w = d·q, q int8) tied to the LM head. Here every Q4_1
tensor stays 4-bit and runs through a weight-only kernel (`kernels.py`); the Q8_0 tensor stays
in its blocks, once (``kernels.BlockRows``): the embedding dequantizes the rows of the ids fed,
exactly (d·q is exact in float32), and the LM head runs through its 8-bit blocks with the top
logits recomputed in float32 from their rows (``kernels.Q8Head``;
positions with few legal tokens get only theirs: ``CompactLlama.head``); norms, rotary,
attention and the KV cache stay float32. The forward is its own rather than transformers' so
that it can fuse q/k/v and gate/up into one 4-bit matmul each, keep the KV cache in one tensor cropped by a length, and make
every token of a verify pass compute exactly what a one-token step would (``_attend``).

Any other transformers model of a family it computes can be converted too
(``from_transformers``): its linear layers quantized the same way as Q4_1 (group 32, affine) or
kept as they are. What a family's layers compute beyond Llama's (Qwen's biases and q/k norms,
Gemma's four norms a layer, GeGLU, scales, sliding windows and soft-caps, Granite's
multipliers) is declared once in ``families.py``; this forward and the fused C++ layers both read
that declaration (``block``).
"""

from __future__ import annotations

import copy
import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import WeightsError
from . import families, kernels
from .machine import setting

# Positions a tile of keys holds (csrc/fused_layers.cpp's KEY_TILE): a cache's keys are (L, KV,
# capacity / KEY_TILE, hd, KEY_TILE), position last within a tile.
KEY_TILE = 16


def _tiles(positions: int) -> int:
    return -(-positions // KEY_TILE)


class CompactCache:
    """Keys and values of every layer in one preallocated tensor each; ``length`` positions are
    valid. Cropping is setting ``length``: rejected drafts' entries are simply overwritten next
    round. Keys are stored in tiles of KEY_TILE positions, position last, so that the fused
    layers' scores of a query are vertical multiply-adds over the positions, read from memory in
    order (csrc/fused_layers.cpp); ``positions_keys`` reads them by position. Values come in
    ``values_dtype``: bf16 behind a 4-bit q/k/v matmul, whose outputs are bf16 (held exactly,
    in half the bytes every step reads), else float32. The buffers come from ``pool`` where it
    has spares and go back to it when the cache is dropped."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        limit: int,
        values_dtype,
        pool: CachePool | None = None,
    ):
        self.length, self.limit, self._pool = 0, limit, pool
        self.keys, self.values = self._buffers((layers, kv_heads, head_dim), capacity, values_dtype)

    @property
    def capacity(self) -> int:
        return self.values.shape[2]

    def positions_keys(self, end: int, layer: int | None = None) -> torch.Tensor:
        """The keys of positions 0..end, (L, KV, end, hd), or of one layer (KV, end, hd): a copy
        out of the tiles."""
        keys = self.keys if layer is None else self.keys[layer]
        return keys[..., : _tiles(end), :, :].transpose(-1, -2).flatten(-3, -2)[..., :end, :]

    def write_keys(self, layer: int, start: int, keys: torch.Tensor) -> None:
        """Store ``keys`` (KV, n, hd) at positions start.. of ``layer``."""
        at = torch.arange(start, start + keys.shape[1], device=keys.device)
        self.keys[layer][:, at // KEY_TILE, :, at % KEY_TILE] = keys.transpose(0, 1)

    def get_seq_length(self) -> int:  # the names kv.py uses for transformers' caches too
        return self.length

    def crop(self, length: int) -> None:
        self.length = length if length >= 0 else self.length + length

    def reserve(self, n: int) -> None:
        """Room for ``n`` more positions (doubling, up to the model's context)."""
        need, have = self.length + n, self.capacity
        if need <= have:
            return
        assert need <= self.limit, f"{need} positions exceed the model's context {self.limit}"
        capacity = min(max(need, 2 * have), self.limit)
        dims = (*self.values.shape[:2], self.values.shape[3])
        keys, values = self._buffers(dims, capacity, self.values.dtype)
        keys[:, :, : _tiles(self.length)] = self.keys[:, :, : _tiles(self.length)]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self._give_back()
        self.keys, self.values = keys, values

    def _buffers(self, dims, capacity: int, values_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        layers, kv_heads, head_dim = dims
        capacity = _tiles(capacity) * KEY_TILE
        spare = self._pool.take(tuple(dims), capacity, values_dtype) if self._pool else None
        if spare is not None:
            return spare
        keys = torch.empty(layers, kv_heads, capacity // KEY_TILE, head_dim, KEY_TILE)
        return keys, torch.empty(layers, kv_heads, capacity, head_dim, dtype=values_dtype)

    def _give_back(self) -> None:
        # Only buffers nobody else holds (2: this object's attribute and the call's argument);
        # a view of a cache must not outlive it (PromptCache keeps clones).
        if (
            self._pool is not None
            and sys.getrefcount(self.keys) == sys.getrefcount(self.values) == 2
        ):
            self._pool.give(self.keys, self.values)

    def __del__(self):
        self._give_back()


class CachePool:
    """Buffers of dropped caches, handed to the next new or growing one: a fresh cache's 8.8 MB
    (the built-in model, 256 positions) are faulted in page by page by the first pass that
    writes them, ~2,200 page faults, 12 ms of kernel time a request on this machine: a sixth of
    a short extract request's time and a quarter of a 16-row batch's (git show 8fe3c79:docs/measurements.md).
    Keeps up to ``limit`` bytes; an entry past a cache's ``length`` is never read, so a spare's
    old contents do no harm. A copied model shares its original's pool."""

    def __init__(self, limit: int):
        self.limit = limit
        self._spare: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.RLock()  # a cache may be dropped while another thread takes one

    def take(self, dims: tuple, capacity: int, values_dtype):
        """The smallest spare (keys, values) of these dims, dtype and at least ``capacity``
        positions, made in the mode (inference or not) torch is in now; None if there is none."""
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            fits = [
                (values.shape[2], i)  # values: (L, KV, capacity, hd)
                for i, (keys, values) in enumerate(self._spare)
                if (*values.shape[:2], values.shape[3]) == dims
                and values.shape[2] >= capacity
                and values.dtype == values_dtype
                and keys.is_inference() == inference
            ]
            return self._spare.pop(min(fits)[1]) if fits else None

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        size = _nbytes(keys) + _nbytes(values)
        with self._lock:
            if self.nbytes + size <= self.limit:
                self._spare.append((keys, values))

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(k) + _nbytes(v) for k, v in self._spare)

    def __deepcopy__(self, memo) -> CachePool:
        return self


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Spare cache buffers a model keeps (CachePool): 7 caches of 256 positions for the built-in model,
# more than a batch's rows free between two admissions.
CACHE_POOL_BYTES = 64 << 20


@dataclass(frozen=True)
class _Kept:
    """A prompt fed before: its ids, and its keys, values and features at every position."""

    ids: tuple[int, ...]
    keys: torch.Tensor  # (L, KV, n / KEY_TILE rounded up, hd, KEY_TILE)
    values: torch.Tensor  # (L, KV, n, hd)
    features: torch.Tensor  # (n, d)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.features))


# Kept prompts' keys, values and features take about 35 kB a token for the built-in model:
# 128 MB holds ~3,700 tokens. CONSTRAINED_SPEC_PROMPT_CACHE_MB sets it; 0 keeps none.
DEFAULT_PROMPT_CACHE_MB = 128.0


def prompt_cache_limit() -> int:
    """Bytes of kept prompts per model (PromptCache), from the environment."""
    mb = setting("CONSTRAINED_SPEC_PROMPT_CACHE_MB", DEFAULT_PROMPT_CACHE_MB, zero="keep none")
    return int(mb * 2**20)


class PromptCache:
    """Prompts fed before, with their keys, values and features, kept up to ``limit`` bytes (least
    recently used first out): a prompt that starts with a kept one's tokens (a shared system
    prompt, instructions, a schema) copies their entries instead of computing them. Exact: the
    fused layers compute a token's entries from its own inputs and the entries before it only,
    however a prompt is split into passes, so a copied entry is the one the forward would write
    (CompactLlama keeps one only while its layers are fused; tests check it bit for bit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._kept: OrderedDict[tuple[int, ...], _Kept] = OrderedDict()
        self._lock = threading.Lock()  # a server's threads may share one model

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self._kept.values())

    def longest(self, ids: list[int]) -> tuple[int, _Kept | None]:
        """The kept prompt sharing the longest prefix with ``ids``, and that prefix's length."""
        with self._lock:
            best, found = 0, None
            for kept in self._kept.values():
                if (n := common_prefix(kept.ids, ids)) > best:
                    best, found = n, kept
            if found is not None:
                self._kept.move_to_end(found.ids)
            return best, found

    def keep(self, ids: list[int], cache: CompactCache, features: torch.Tensor) -> None:
        """Keep the prompt ``ids`` that ``cache`` holds, unless a kept one starts with it; kept
        ones it starts with go (it holds them)."""
        key, n = tuple(ids), len(ids)
        with self._lock:
            for kept in list(self._kept.values()):
                if kept.ids[:n] == key:  # as long or longer: it holds this prompt already
                    self._kept.move_to_end(kept.ids)
                    return
                if key[: len(kept.ids)] == kept.ids:
                    del self._kept[kept.ids]
            entry = _Kept(
                key,
                cache.keys[:, :, : _tiles(n)].clone(),
                cache.values[:, :, :n].clone(),
                features[:n].clone(),
            )
            if entry.nbytes > self.limit:
                return
            self._kept[key] = entry
            while self.nbytes > self.limit:
                self._kept.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __deepcopy__(self, memo) -> PromptCache:
        return PromptCache(self.limit)  # a copied model starts with nothing kept


def common_prefix(a, b) -> int:
    """How many leading items two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Config(SimpleNamespace):
    """A model config's fields as plain values (transformers' config, as its JSON has them): what
    a compact model keeps, so that a prepared model loads without transformers."""

    @classmethod
    def of(cls, config) -> Config:
        if isinstance(config, cls):
            return config
        return cls(**json.loads(config.to_json_string(use_diff=False)))

    def to_dict(self) -> dict:
        return copy.deepcopy(vars(self))


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    context: int


class CompactLlama(nn.Module):
    """A causal LM of one of families.FAMILIES (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite,
    Gemma 2 and 3):
    ``model(ids, cache)`` → (logits (n, V), LM-head inputs (n, d)). What each layer computes
    (its norms, activation, scales, rotary and window) is ``block``, its family's declaration.

    Offers what the rest of the package reads off a transformers model: ``config``,
    ``get_input_embeddings()`` (called on ids as nn.Embedding is), ``get_output_embeddings()``
    (whose float32 rows kv.head_rows reads: the draft head's).
    ``tensor_types``: how each of the file's tensor types runs (GGUF files: models.describe_weights says them)."""

    def __init__(
        self,
        config,
        embed: torch.Tensor | nn.Module,
        lm_head: nn.Module,
        norms: list,
        linears: list,
        weights: str,
        biases: list | None = None,
        qk_norms: list | None = None,
        rope: torch.Tensor | None = None,
    ):
        """``embed``: the token embedding (V, d): float32 rows, or a table of them (a
        kernels.BlockRows of Q8_0 or Q6_K blocks; a tied model's: its Q8Head's table, one copy); ``norms``:
        per layer its block's RMSNorm weights (families.Block.norms of them, in the order they
        apply), then the final one; ``biases``: per layer the q/k/v matmul's bias (width,)
        (Qwen2); ``qk_norms``: per layer the query and the key heads' RMSNorm weights (hd,)
        (Qwen3, Gemma 3); ``rope``: the rotary inverse frequencies (3, hd/2) of
        families.ROTARY_ROWS where the config's do not say them (a GGUF's factors)."""
        super().__init__()
        self.weights = weights
        if isinstance(embed, torch.Tensor):
            embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.embed = embed  # (V, d)
        self.lm_head = lm_head  # (V, d): a kernels.Q8Head (4-bit paths) or kernels.DenseLinear
        self.norms = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in norms)
        self.linears = nn.ModuleList(linears)  # per layer: qkv, o, gate_up, down
        self.biases = [b.float().contiguous() for b in biases or []]
        self.qk_norms = [w.float().contiguous() for w in qk_norms or []]
        self.rope = rope if rope is not None else families.rotary_frequencies(config)
        self.tensor_types: dict[str, int] = {}
        self.prefill = "int4"  # the 4-bit linears' kernel for long inputs (use_prefill)
        self.layer_kernel = "python"  # how steps, verify passes and batches run (use_layers)
        self.start(Config.of(config))

    def start(self, config: Config) -> None:
        """What a model holds beside its weights and kernel choices (a prepared model's load
        restores those, then calls this)."""
        self.config, self.shape = config, _shape(config)
        self.block = families.block_of(config)
        if self.rope.dim() == 1:  # prepared before rotary per layer kind: one row for all
            self.rope = torch.stack((self.rope, self.rope))
        if self.rope.shape[0] == 2:  # prepared before layers without rotary: their row
            self.rope = torch.cat((self.rope, torch.zeros_like(self.rope[:1])))
        assert len(self.norms) == self.shape.layers * self.block.norms + 1, "norms per block"
        self._cos = self._sin = None  # rotary factors by position (_rotary)
        self._fused = None  # the fused layers' arguments, where they run
        self.prompt_cache: PromptCache | None = None  # kept prompts, while the layers are fused
        self.cache_pool = CachePool(CACHE_POOL_BYTES)  # dropped caches' buffers, for new ones
        self._layers_on_ours = self.layer_kernel  # what use_matmul restores after torch's kernel
        self.use_layers(self.layer_kernel)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    @property
    def vocab_size(self) -> int:
        return self.embed.num_embeddings

    @property
    def device(self) -> torch.device:
        return self.norms[-1].device

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def use_prefill(self, kernel: str) -> None:
        """The 4-bit linears' kernel for a prompt's prefill (kernels.PREFILL_ROWS tokens or more)
        through the Python layers (the fused layers take prompts like any other input), never a
        step or a verify pass, so the baseline and speculation still compute the same function
        after it. The fused layers take "amx-bf16", "avx512-bf16" (or "int4") for every prompt
        they feed: its rows are independent, so a kept prompt's remainder adds what a fresh
        prompt would."""
        assert kernel in kernels.PREFILL_KERNELS, kernel
        if kernel == self.prefill:  # a prepared model's copy is already there
            return
        if self._fused is not None and kernel == "bf16":
            raise WeightsError(
                "the fused layers' prompts take 'int4', 'amx-bf16' or 'avx512-bf16', not 'bf16'"
            )
        for linear in self.linears:
            if isinstance(linear, kernels.Int4Linear):
                linear.use_prefill(kernel)
        self.prefill = kernel
        if self.prompt_cache is not None:
            self.prompt_cache.clear()  # kept entries are the old kernel's values

    def use_layers(self, kernel: str) -> None:
        """How steps, verify passes and batch rows run the layers: "fused" (one call of the
        kernel library, kernels.fused_library; our 4-bit kernels only) or "python" (a loop of
        torch ops). Both compute the same function up to float rounding, and each computes a
        token's values from its own inputs alone; one of them runs for a model's whole life
        (baseline and speculation share it), so greedy speculation still commits the baseline's
        tokens. The fused layers also take prompts, keeping them for reuse (``prompt_cache``,
        up to prompt_cache_limit())."""
        assert kernel in kernels.LAYER_KERNELS, kernel
        self._fused = self.prompt_cache = None  # kept entries are the old layers' values
        if kernel == "fused":
            library, missing = kernels.fused_library()
            if missing:
                raise WeightsError(f"the fused layers cannot run here: {missing}")
            if not all(isinstance(m, kernels.Int4Linear) for m in self.linears):
                raise WeightsError(
                    "the fused layers run 4-bit linears only: weights='float' "
                    "runs its layers in Python"
                )
            if self.matmul == "torch":
                raise WeightsError(
                    "the fused layers run our 4-bit kernels only: with torch's ('torch') the "
                    "layers run in Python (use_matmul another of kernels.INT4_KERNELS first)"
                )
            linears = list(self.linears)
            self._fused = library.fused_model(  # the weights' pointers, once
                kernels.table_tensors(self.embed), linears, [m.copies for m in linears],
                list(self.norms)[:-1], self.biases, self.qk_norms, self.norms[-1], self.shape,
                self.block,
            )  # fmt: skip
            if limit := prompt_cache_limit():
                self.prompt_cache = PromptCache(limit)
        self.layer_kernel = kernel

    def use_matmul(self, kernel: str) -> None:
        """Which of kernels.INT4_KERNELS runs the 4-bit linears (all of them: a step, a verify
        pass, a batch row and a prompt through the "int4" prefill kernel multiply alike) and
        the Q8_0 LM head's blocks. torch's ("torch") runs the Python layers: the kernel library
        cannot call it."""
        assert kernel in kernels.INT4_KERNELS, kernel
        if not all(isinstance(m, kernels.Int4Linear) for m in self.linears):
            raise WeightsError("a 4-bit kernel runs 4-bit linears only: these are float")
        if self.matmul != "torch":  # the layers ours ran, for when they come back
            self._layers_on_ours = self.layer_kernel
        self._fused = self.prompt_cache = None  # its old packs: each freed once re-laid
        for linear in self.linears:
            linear.use_kernel(kernel)
        if isinstance(self.lm_head, kernels.Q8Head):  # its blocks too, the bound following
            self.lm_head.use_kernel(kernel)
        layers = "python" if kernel == "torch" else self._layers_on_ours
        self.use_layers(layers)  # the fused layers' arguments: the new packs

    @property
    def matmul(self) -> str | None:
        """The 4-bit kernel of the linears (kernels.INT4_KERNELS), None for float ones."""
        first = self.linears[0]
        return first.kernel if isinstance(first, kernels.Int4Linear) else None

    def use_head(self, kernel: str) -> None:
        """The LM head of a 4-bit model: "q8" (its Q8_0 blocks, the top logits in float32) or
        "float" (float32 throughout); both give the same largest logit (kernels.Q8Head)."""
        assert kernel in kernels.HEAD_KERNELS, kernel
        if kernel == "float" and isinstance(self.lm_head, kernels.Q8Head):
            self.lm_head = kernels.DenseLinear(self.lm_head.dequantized())
        elif kernel == "q8" and not isinstance(self.lm_head, kernels.Q8Head):
            self.lm_head = kernels.Q8Head(self.lm_head.weight.data)
            if self.matmul:
                self.lm_head.use_kernel(self.matmul)

    def feed_prompt(self, ids: list[int], cache: CompactCache) -> tuple[torch.Tensor, int]:
        """Feed a prompt into an empty ``cache``: its features (n, d), and how many of its
        tokens were copied from a kept prompt (``prompt_cache``) rather than computed."""
        cached, kept = self.prompt_cache.longest(ids) if self.prompt_cache else (0, None)
        features = []
        if cached:
            cache.reserve(cached)
            cache.keys[:, :, : _tiles(cached)] = kept.keys[:, :, : _tiles(cached)]
            cache.values[:, :, :cached] = kept.values[:, :, :cached]
            cache.length = cached
            features.append(kept.features[:cached])
        if cached < len(ids):
            fed = torch.tensor(ids[cached:], dtype=torch.long, device=self.device)
            features.append(self.forward_rows([fed], [cache], logits=False, prompt=True)[1])
        features = torch.cat(features)
        if self.prompt_cache is not None:
            self.prompt_cache.keep(ids, cache, features)
        return features, cached

    def new_cache(self) -> CompactCache:
        s = self.shape
        bf16 = isinstance(self.linears[0], kernels.Int4Linear)  # its outputs are bf16
        dtype = torch.bfloat16 if bf16 else torch.float32
        return CompactCache(
            s.layers, s.kv_heads, s.head_dim, min(256, s.context), s.context, dtype, self.cache_pool
        )

    def forward(self, ids: torch.Tensor, cache: CompactCache, logits: bool = True, masks=None):
        """Feed ``ids`` (n,) after the cache's positions; returns their logits (None unless
        ``logits``; ``masks``: see ``head``) and features."""
        return self.forward_rows([ids], [cache], logits, masks)

    @torch.inference_mode()
    def forward_rows(
        self,
        rows: list[torch.Tensor],
        caches: list[CompactCache],
        logits=True,
        masks=None,
        prompt=False,
    ):
        """Feed each row's ids after its own cache's positions, the rows' tokens stacked through
        every matmul (the weights are read once for all rows), attention per row. Returns logits
        (None unless ``logits``; ``masks``: see ``head``) and features, (Σn, ·), the rows in
        order. A row's values do not depend on the other rows: 4-bit kernel rows are independent
        of how many are fed, and so are the LM head's (``head``), so a row of a batch computes
        what it would alone. ``prompt``: one row, a prompt (feed_prompt), which the fused
        layers feed through the prefill kernel where it is ours on the copy (DENSE_KERNELS)."""
        s, sizes = self.shape, [ids.shape[0] for ids in rows]
        starts = [cache.length for cache in caches]
        # a prompt's prefill through the Python layers (the fused ones take every input alike)
        long = self._fused is None and len(rows) == 1 and sizes[0] >= kernels.PREFILL_ROWS
        for cache, n in zip(caches, sizes):
            cache.reserve(n)
        cos, sin = self._rotary(max(a + n for a, n in zip(starts, sizes)))
        ids = torch.cat(rows) if len(rows) > 1 else rows[0]
        if self._fused is not None:
            keys, values = [c.keys for c in caches], [c.values for c in caches]
            on_copy = prompt and self.prefill in kernels.DENSE_KERNELS
            dense = [m.dense for m in self.linears] if on_copy else None
            features = kernels.fused_if_built().fused_layers(
                self._fused, self.block, ids, cos, sin, keys, values, starts, sizes, dense,
                self.prefill == "amx-bf16",
            )  # fmt: skip
        else:
            at = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, sizes)])
            seen = _prompt_masks(sizes[0], starts[0], self.block.windows) if long else None
            x = self.embed(ids)
            if self.block.embed_scale != 1.0:
                x = x * self.block.embed_scale
            x = self._python_layers(x, caches, starts, sizes, cos[:, at], sin[:, at], long, seen)
            features = F.rms_norm(x, (s.hidden,), self.norms[-1], s.eps)  # (N, d)
        for cache, start, n in zip(caches, starts, sizes):
            cache.length = start + n
        return (self.head(features, masks) if logits else None), features

    def _rotary(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary factors cos, sin (3, P, hd) of positions 0..P-1, P ≥ ``positions``, of
        families.ROTARY_ROWS (Block.rotary): computed once (doubling as inputs reach further),
        not per call."""
        have = 0 if self._cos is None else self._cos.shape[1]
        if have < positions:
            count = min(max(positions, 2 * have, 256), max(self.shape.context, positions))
            angles = torch.arange(count, dtype=torch.float32)[None, :, None] * self.rope[:, None]
            cos, sin = angles.cos(), angles.sin()  # (3, P, hd/2)
            if (scale := self.block.rotary_scale) != 1.0:  # LongRoPE's, on the pairs that rotate
                scale = torch.where(self.rope[:, None] != 0, scale, 1.0)
                cos, sin = cos * scale, sin * scale
            self._cos = cos.repeat(1, 1, 2).contiguous()
            self._sin = sin.repeat(1, 1, 2).contiguous()
        return self._cos, self._sin

    def _python_layers(self, x, caches, starts, sizes, cos, sin, long, seen) -> torch.Tensor:
        """The layers as torch ops (what the fused ones compute, up to float rounding); cos,
        sin (3, N, hd): each token's rotary factors; seen: a prompt's attention masks by
        window (long: _prompt_masks)."""
        s, b, total = self.shape, self.block, sum(sizes)
        k, act = b.norms, _ACTIVATIONS[b.activation]
        for layer in range(s.layers):
            qkv, o, gate_up, down = self.linears[4 * layer : 4 * layer + 4]
            norms = self.norms[k * layer : k * layer + k]  # (k, d): in the order they apply
            h = qkv(F.rms_norm(x, (s.hidden,), norms[0], s.eps), long)
            if self.biases:
                h = h + self.biases[layer]
            h = h.view(total, s.heads + 2 * s.kv_heads, s.head_dim).transpose(0, 1)
            qk = h[: s.heads + s.kv_heads]
            if self.qk_norms:  # each head's RMSNorm, before rotary
                q_norm, k_norm = self.qk_norms[2 * layer : 2 * layer + 2]
                qk = torch.cat(
                    (
                        F.rms_norm(qk[: s.heads], (s.head_dim,), q_norm, s.eps),
                        F.rms_norm(qk[s.heads :], (s.head_dim,), k_norm, s.eps),
                    )
                )
            table = b.rotary[layer]
            qk = _rotate(qk, cos[table], sin[table])  # q and k heads at once
            window, parts, offset = b.windows[layer], [], 0
            for cache, start, n in zip(caches, starts, sizes):
                new = slice(offset, offset + n)
                cache.write_keys(layer, start, qk[s.heads :, new])
                cache.values[layer, :, start : start + n] = h[s.heads + s.kv_heads :, new]
                keys, values = cache.positions_keys(start + n, layer), cache.values[layer]
                mask = seen[window] if seen else None
                q = qk[: s.heads, new]
                parts.append(
                    _attend(
                        q, keys, values, start, mask, window, b.attention_scale, b.attention_cap
                    )
                )
                offset += n
            a = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # (H, N, hd)
            a = o(a.transpose(0, 1).reshape(total, -1), long)  # (N, d)
            if k == 4:  # the branch's output normed before the residual add (SANDWICH_NORMS)
                a = F.rms_norm(a, (s.hidden,), norms[1], s.eps)
            x = _add_branch(x, a, b.residual_scale)
            h = gate_up(F.rms_norm(x, (s.hidden,), norms[k // 2], s.eps), long)
            g, u = h.chunk(2, dim=-1)  # (N, I) each
            m = down(act(g) * u, long)
            if k == 4:
                m = F.rms_norm(m, (s.hidden,), norms[3], s.eps)
            x = _add_branch(x, m, b.residual_scale)
        return x

    def head(self, features: torch.Tensor, masks: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (N, V) of ``features`` (N, d). With ``masks`` (N, V) bool, the legal tokens at
        each position, a position with few legal tokens (at most V·NARROW) gets only theirs, in
        float32 from their rows of the LM head, and −inf elsewhere; the others get the whole
        head (a Q8Head recomputes their top legal logits in float32). The acceptance rule masks
        every illegal logit anyway. A position's values depend on its own features and mask
        only (4-bit kernel rows are independent), so a step, a verify pass and a batch row
        compute the same; the float target's dense head only up to its last bits. Every logit
        ÷ Block.logit_scale (Granite's logits_scaling) where it is not 1: after a Q8Head chose
        which to recompute, a choice that dividing every logit and its bound by the same
        positive number would leave as it is. Then soft-capped where the family caps them
        (Block.logit_cap, Gemma 2), which keeps that choice and the bound too: cap·tanh(x / cap)
        is increasing, so the largest legal logit stays the largest, and 1-Lipschitz (its slope
        1 − tanh² ≤ 1), so a logit within b of float32's is capped to within b of float32's
        capped one."""
        logits = self._head(features, masks)
        if self.block.logit_scale != 1.0:
            logits /= self.block.logit_scale
        if cap := self.block.logit_cap:  # a narrow position's −inf stay −inf
            logits = soft_cap(logits, cap).masked_fill_(logits == float("-inf"), float("-inf"))
        return logits

    def _head(self, features: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
        if masks is None or features.device.type != "cpu":  # counting rows would sync a GPU
            return self._whole_head(features, masks)
        vocab = self.vocab_size
        assert masks.shape == (features.shape[0], vocab), "one mask per position"
        counts, limit = legal_counts(masks), NARROW * vocab
        narrow = [i for i, c in enumerate(counts) if c <= limit]
        if not narrow:
            return self._whole_head(features, masks)
        logits = features.new_full(masks.shape, float("-inf"))
        if wide := [i for i, c in enumerate(counts) if c > limit]:
            logits[wide] = self._whole_head(features[wide], masks[wide])
        for i in narrow:
            legal = masks[i].nonzero().squeeze(1)
            logits[i, legal] = self.lm_head.rows(legal) @ features[i]
        return logits

    def _whole_head(self, features: torch.Tensor, masks: torch.Tensor | None) -> torch.Tensor:
        if isinstance(self.lm_head, kernels.Q8Head):
            return self.lm_head(features, masks)
        return self.lm_head(features)


# JSON's positions are mostly either narrow (keys, numbers, punctuation: at most ~100 of 49,152
# tokens legal, 40% of verify positions on 8 extract requests) or wide (string contents: a quarter
# of the vocabulary or more); a narrow one costs a gather of its rows instead of the whole head,
# which streams 113 MB of float32 and was a quarter of a one-token step.
NARROW = 1 / 16


def legal_counts(masks: torch.Tensor) -> list[int]:
    """Each position's number of legal tokens: the compiled count where the fused layers are
    built (torch sums a bool tensor through int64: 15 ms of an 81 ms round of 16 rows), else as
    bytes."""
    compiled = kernels.fused_if_built()
    if compiled is not None and masks.is_contiguous():
        return compiled.count_legal(masks)
    return masks.view(torch.uint8).sum(1, dtype=torch.int32).tolist()


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap·tanh(x / cap) (Gemma 2's soft-capping, as transformers computes it); ``x`` itself
    where cap is 0."""
    return x if not cap else torch.tanh(x / cap) * cap


# Up to this many new tokens (every verify pass: drafts are at most 24), each one attends by
# itself (from kernels.PREFILL_ROWS on, a prompt's tokens attend in one masked call), exactly as a one-token step at its position would: the 4-bit kernel's bf16 rounding of
# every matmul input turns a masked kernel's last-bit differences into visible ones (0.15 in the
# logits at 2 tokens), and greedy speculation must commit the baseline's tokens.
ROW_EXACT = 32


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
    window: int,
    scale: float,
    cap: float = 0.0,
) -> torch.Tensor:
    """Attention of q (H, n, hd) at positions start.. over the cached keys/values (KV, T, hd),
    scores q·k × ``scale``, soft-capped by ``cap`` (0: none); with a ``window``, a key at
    distance ≥ window is masked."""
    n = q.shape[1]
    keys = keys[:, : start + n].contiguous()
    values = values[:, : start + n].float()  # stored in bf16, exactly
    if mask is not None:  # a prompt's prefill: one masked call
        return _softmax_attention(q, keys, values, mask, scale, cap)
    seen = [(max(0, start + i + 1 - window) if window else 0, start + i + 1) for i in range(n)]
    return torch.cat(
        [
            _softmax_attention(
                q[:, i : i + 1], keys[:, lo:end], values[:, lo:end], None, scale, cap
            )
            for i, (lo, end) in enumerate(seen)
        ],
        dim=1,
    )  # (H, n, hd)


def _softmax_attention(q, keys, values, mask, scale: float, cap: float) -> torch.Tensor:
    """softmax(q·k × scale, soft-capped, masked)·v of q (H, n, hd) over keys, values (KV, T, hd),
    mask (n, T) bool or None. Without a cap torch's fused attention (which has no soft-cap),
    else the scores as transformers' eager Gemma 2 attention computes them."""
    if not cap:
        return F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, enable_gqa=True, scale=scale
        )[0]
    group = q.shape[0] // keys.shape[0]  # query heads per key/value head
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = soft_cap(q @ keys.transpose(1, 2) * scale, cap)  # (H, n, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ values  # (H, n, hd)


def _prompt_masks(n: int, start: int, windows) -> dict[int, torch.Tensor]:
    """A prompt's attention masks (n, start + n) by window (0: none): token i (at start + i)
    sees every cached position and the new ones up to itself, within its window."""
    causal = torch.ones(n, start + n, dtype=torch.bool).tril(start)
    return {w: causal.triu(start - w + 1) if w else causal for w in set(windows)}


def _add_branch(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
    """x + branch·scale: a branch's residual add (Granite scales the branch first; 1 skips the
    multiply, leaving other families' sums as they were)."""
    return x + branch * scale if scale != 1.0 else x + branch


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def _shape(config) -> Shape:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shape(
        config.num_hidden_layers,
        config.hidden_size,
        heads,
        config.num_key_value_heads,
        head_dim,
        float(config.rms_norm_eps),
        families.context_of(config),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # transformers' layout: the rotated pairs are (i, i + hd/2)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --- loading ----------------------------------------------------------------------------------


def check_compact(config, weights: str) -> None:
    """A WeightsError naming what ``config`` asks for that the compact forward does not compute
    (families.check): computing it without would be silently wrong (a Qwen2 checkpoint's q/k/v
    biases dropped gave logits 0.71 off transformers' and another top token at 6 of 6
    positions)."""
    families.check(config, weights)


def from_transformers(model, weights: str = "int4") -> CompactLlama:
    """A transformers model of one of families.FAMILIES in the compact forward: ``"int4"``
    quantizes its linears as Q4_1, ``"int8"`` as Q8_0, both with the LM head as Q8_0 (as
    llama.cpp quantizes them); ``"float"`` keeps every weight as it is, in float32. Biases
    (q/k/v only) and norms stay float32 (norms as llama.cpp's converter stores them: Gemma's
    1 + w)."""
    config = model.config
    family = families.check(config, weights)
    qkv_names = [module.rsplit(".", 1)[-1] for _, module in family.linears[0]]
    odd = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.bias is not None and n.rsplit(".", 1)[-1] not in qkv_names
    ]
    if odd or not hasattr(getattr(model, "model", None), "layers"):
        what = f"the bias of {odd[0]}" if odd else f"{type(model).__name__}'s layout"
        raise WeightsError(
            f"weights={weights!r}: the compact forward does not compute {what}: use "
            "weights='float' (transformers' own forward)."
        )
    linear = {
        "int4": lambda w: kernels.Int4Linear.from_q4_1(*kernels.quantize_q4_1(w)),
        "int8": lambda w: kernels.Int4Linear.from_q8_0(*kernels.quantize_q8_0(w)),
        "float": kernels.DenseLinear,
    }[weights]
    lm_head = model.get_output_embeddings().weight.detach().float()
    embed = model.get_input_embeddings().weight.detach().float()
    tied = lm_head.data_ptr() == embed.data_ptr()
    if weights == "float":
        head = kernels.DenseLinear(lm_head)  # the same storage as the embedding where tied
    else:  # Q8_0 values, which the head keeps as their blocks (kernels.BlockRows)
        head = kernels.Q8Head(kernels.dequantize_q8_0(*kernels.quantize_q8_0(lm_head)))
        embed = head.table if tied else embed

    def norm(module) -> torch.Tensor:
        return module.weight.detach().float() + family.norm_offset

    order = families.qkv_row_order(config)  # partial rotary: each q/k head's rotated dims first
    norms, linears, biases, qk_norms = [], [], [], []
    for layer in model.model.layers:
        # each of the block's four linears: its modules' rows stacked (family.linears)
        groups = [[layer.get_submodule(name) for _, name in group] for group in family.linears]
        w = [torch.cat([m.weight.detach().float() for m in group]) for group in groups]
        qkv = groups[0]
        if order is not None:
            w[0] = w[0][order]
        linears += [linear(x) for x in w]
        norms += [norm(getattr(layer, name)) for _, name in family.norms]
        if any(m.bias is not None for m in qkv):
            bias = torch.cat(
                [
                    m.weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach()
                    for m in qkv
                ]
            ).float()
            biases.append(bias if order is None else bias[order])
        if family.qk_norms:
            attn = layer.self_attn
            qk_norms += [norm(attn.q_norm), norm(attn.k_norm)]
    norms.append(norm(model.model.norm))
    return CompactLlama(
        config, embed, head, norms, linears, weights, biases or None, qk_norms or None
    )
