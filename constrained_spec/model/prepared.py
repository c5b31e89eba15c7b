"""Prepared models: what a model's later loads read instead of its file's metadata, stored once
per model file. Two kinds, one layout:

* run from the file (a GGUF whose blocks model/repack lays into the kernels' layout at load, in
  seconds): ``<key>.json`` holds the config, the tokenizer (in the form it loads fastest from,
  model.tokenizer) and the GGUF's header (its scalar metadata and tensor table: no metadata parse
  at a later load, and no transformers), ``<key>.pt`` the LM head's bound terms for its kernel
  (kernels.Q8Head: a pass over every row of the head, 1-2 s at a 150k vocabulary). A few MB, where
  the weights laid out would take 1-4x the file.
* converted (where the repack library cannot be had: the torch path, a minute or more a load):
  ``<key>.pt`` holds the whole model as its kernels run it (4-bit blocks in the chosen kernel's
  layout, the prompts' bf16 copy, the LM head's Q8_0 blocks and bounds, the embedding's and the
  head's rows: Q8_0 and Q6_K ones as their blocks, kernels.BlockRows, once where tied), mapped
  by later loads (``torch.load(mmap=True)``: no copy); ``<key>.json`` its config and tokenizer.

Layout: ``cache_dir()/prepared/<key>.pt`` and ``<key>.json`` (read without touching the tensors),
the key a hash of the source file's path, size and modification time, this module's FORMAT,
torch's version and the CPU (the kernels' layouts follow the CPU's features). A file that does
not load (truncated, another format) is rebuilt; a cache without room for one is skipped, and
said so. ``index.json`` names each file's source: storing one removes those whose source is gone
or changed. Prepared models take at most `$CONSTRAINED_SPEC_CACHE_GB` together (DEFAULT_CAP_GB):
storing one removes those used least recently until it fits, one larger than the cap is not
stored; each store of a converted model says what it wrote.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import kernels, llama
from .machine import atomic_write, cache_dir, cpu_name, say, setting, unwritable
from .tokenizer import Tokenizer

# v2: Q8_0 embeddings and head rows as their blocks (kernels.Q8Rows); v3: a BPE tokenizer's
# vocabulary and merges as ids (model.tokenizer's fast form); v4: Q6_K ones too, as their
# blocks (kernels.BlockRows, Q8Rows' successor: Gemma 2 2B's embedding 0.74 GB, was 2.4 in float32);
# v5: a GGUF run from the file stores its header and the head's terms, no weights
FORMAT = "prepared v5"

# the modules a compact model is made of, by the name the file stores
_MODULES = {
    c.__name__: c
    for c in (
        llama.CompactLlama,
        kernels.Int4Linear,
        kernels.Q8Head,
        kernels.BlockRows,
        kernels.DenseLinear,
    )
}
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def path_for(source: Path) -> Path:
    """Where the prepared form of the model file ``source`` lives (whether or not it does): one
    per torch, CPU and kernel library variant (whose kernels' layouts it holds)."""
    stat = source.stat()
    what = f"{FORMAT} | {source.resolve()} | {stat.st_size} | {stat.st_mtime_ns} | "
    what += f"torch {torch.__version__} | {cpu_name()} | kernels {kernels.library_key()}"
    return cache_dir() / "prepared" / f"{hashlib.sha256(what.encode()).hexdigest()[:24]}.pt"


@dataclass(frozen=True)
class Stored:
    """What a prepared model holds: ``model`` where the model is stored whole (converted),
    else the GGUF's header (``gguf``: GGUFHeader.state) and the head's bound terms for
    ``layout``'s kernel."""

    config: llama.Config
    tokenizer: Tokenizer
    model: llama.CompactLlama | None = None
    gguf: dict | None = None
    layout: str | None = None
    terms: torch.Tensor | None = None


def load(source: Path) -> Stored | None:
    """The prepared model of ``source``, its tensors mapped; None where none is stored (or it
    does not load: it is then removed, to be rebuilt)."""
    path = path_for(source)
    if (header := _header(path)) is None:
        return None
    try:
        state = torch.load(path, mmap=True, weights_only=True)
        config = llama.Config(**header["config"])
        tokenizer = Tokenizer.from_state(header["tokenizer"])
        if header.get("weights", True):
            model = _restore(state)
            model.start(config)
            loaded = Stored(config, tokenizer, model=model.eval())
        else:
            layout, terms = state["layout"], state["terms"]
            assert isinstance(layout, str) and terms.shape == (config.vocab_size, 4)
            loaded = Stored(config, tokenizer, gguf=header["gguf"], layout=layout, terms=terms)
    except Exception as err:  # noqa: BLE001 - any damage means: rebuild it
        say(
            f"The prepared model {path} does not load ({type(err).__name__}: {err}); rebuilding it."
        )
        _remove(path)
        return None
    with contextlib.suppress(OSError):  # its last use, for the cap (read-only caches: none)
        os.utime(path)
    if _read_index(path.parent / "index.json").get(path.name) != str(source.resolve()):
        try:  # an index lost or damaged: written again, so that stale files are swept
            _sweep(path, source)
        except OSError:
            pass
    return loaded


def config(source: Path) -> llama.Config | None:
    """The config of ``source``'s prepared model, where one is stored (no tensor is read)."""
    header = _header(path_for(source))
    return llama.Config(**header["config"]) if header else None


def tokenizer(source: Path) -> Tokenizer | None:
    """The tokenizer of ``source``'s prepared model, where one is stored."""
    path = path_for(source)
    if (header := _header(path)) is None:
        return None
    try:
        return Tokenizer.from_state(header["tokenizer"])
    except Exception as err:  # noqa: BLE001 - any damage means: rebuild it
        _damaged(path, f"its tokenizer does not load ({type(err).__name__})")
        return None


def _header(path: Path) -> dict | None:
    """The config and tokenizer stored beside a prepared model (``<key>.json``), where both
    files are there and the header is whole; a damaged one is removed with its model (to be
    rebuilt), and said so."""
    try:
        stat = path.with_suffix(".json").stat()
        if not path.is_file():
            return None
    except OSError:
        return None
    try:
        return _read_header(path.with_suffix(".json"), stat.st_mtime_ns, stat.st_size)
    except (OSError, ValueError, RecursionError) as err:
        _damaged(path, str(err) if isinstance(err, _NotAHeader) else type(err).__name__)
        return None


class _NotAHeader(ValueError):
    pass


@functools.lru_cache(maxsize=4)
def _read_header(path: Path, mtime_ns: int, size: int) -> dict:
    header = json.loads(path.read_bytes())
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _NotAHeader(f"not a header of {FORMAT}")
    config, state = header.get("config"), header.get("tokenizer")
    if not (isinstance(config, dict) and all(isinstance(k, str) for k in config)):
        raise _NotAHeader("its config is not a JSON object")
    if not (isinstance(state, dict) and isinstance(state.get("backend"), str)):
        raise _NotAHeader("its tokenizer is not a JSON object with a backend")
    return header


def _damaged(path: Path, why: str) -> None:
    say(f"The prepared model {path.with_suffix('.json')} is damaged ({why}); rebuilding it.")
    _remove(path)


def save_later(
    source: Path, model: llama.CompactLlama, tokenizer: Tokenizer, gguf: dict | None = None
) -> None:
    """Store the prepared form of ``source``: where ``gguf`` (the file's GGUFHeader.state) is
    given, the model runs from the file and only its header and head terms are stored; else
    the model's tensors and attributes (``<key>.pt``), then its config and tokenizer
    (``<key>.json``), each written whole and renamed into place. In a thread, so that a model's
    first requests do not wait for the write (a 1.5B model's 5.7 GB: 13 s on this machine's
    disk); the interpreter waits for it at exit, ``wait()`` before (a process that ends by
    os._exit must call it)."""
    cap = cap_bytes()  # a bad setting is said here, not in the thread
    state, header = _snapshot(model, tokenizer, gguf)
    thread = threading.Thread(
        target=_write, args=(source, state, header, cap), name="prepare-model"
    )
    thread.start()
    _writing.append(thread)


def wait() -> None:
    """Until the prepared files being written are stored."""
    while _writing:
        _writing.pop().join()


_writing: list[threading.Thread] = []


def _snapshot(model: llama.CompactLlama, tokenizer: Tokenizer, gguf: dict | None):
    """The model's state as of now (a later kernel choice replaces tensors, never writes into
    them) or, run from the file, its head's terms; and the header."""
    header = {"format": FORMAT, "config": model.config.to_dict(), "tokenizer": tokenizer.state()}
    if gguf is None:
        return _state(model), header | {"weights": True}
    terms = {"layout": model.matmul, "terms": model.lm_head.terms.clone()}
    return terms, header | {"weights": False, "gguf": gguf}


CAP_ENV = "CONSTRAINED_SPEC_CACHE_GB"
DEFAULT_CAP_GB = 4.0  # prepared models on disk, all together (the default model's: 0.15-0.35 GB)
STALE_TMP_S = 3600.0  # a part-written file this old belongs to a write that died


def cap_bytes() -> int:
    """How much disk the prepared models may take, all together: `$CONSTRAINED_SPEC_CACHE_GB`
    (SettingError for a bad value), else DEFAULT_CAP_GB."""
    return int(setting(CAP_ENV, DEFAULT_CAP_GB, zero="store no prepared model") * 1e9)


def _write(source: Path, state: dict, header: dict, cap: int) -> None:
    path = path_for(source)
    text = json.dumps(header)
    size = _stored_bytes(state) + len(text.encode())  # the header too: most of a laid model's
    try:
        if size > cap:
            say(
                f"Not storing the prepared model ({_mb(size)}): more than the cap of "
                f"{cap / 1e9:g} GB for prepared models; set {CAP_ENV} higher to keep it "
                "(later loads then map it instead of converting the model again)."
            )
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free < size + (1 << 30):  # keep 1 GB free
            say(f"Not storing the prepared model ({_mb(size)}): {path.parent} is nearly full.")
            return
        _remove(path)  # the header last: a file without one is never read
        _make_room(path.parent, size, cap)
        crc32 = torch.serialization.get_crc32_options()
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
            try:  # without the zip's checksums: 2 GB/s instead of 0.4 (a 1.5B model's 5.7 GB)
                torch.serialization.set_crc32_options(False)
                torch.save(state, f)
            except BaseException:
                Path(f.name).unlink(missing_ok=True)
                raise
            finally:
                torch.serialization.set_crc32_options(crc32)
        os.replace(f.name, path)
        atomic_write(path.with_suffix(".json"), text)
        _sweep(path, source)
        written = path.stat().st_size + path.with_suffix(".json").stat().st_size
        say(
            f"Stored the prepared model of {source.name} ({_mb(written)}) in {path.parent}: "
            f"prepared models take {_mb(_usage(path.parent))} of {cap / 1e9:g} GB ({CAP_ENV})."
        )
    except OSError as err:  # a read-only or full cache: the model still runs, converted again
        unwritable(err)


def _make_room(folder: Path, size: int, cap: int) -> None:
    """Remove the least recently used prepared models until ``size`` more bytes fit the cap
    (and part-written files of writes that died)."""
    now = time.time()
    for part in folder.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - part.stat().st_mtime > STALE_TMP_S:
                part.unlink()
    used = _usage(folder)
    for old in sorted(folder.glob("*.pt"), key=_last_use):
        if used + size <= cap:
            break
        freed = _usage(folder, [old, old.with_suffix(".json")])
        _remove(old)
        used -= freed
        say(
            f"Removed the prepared model {old.name} ({_mb(freed)}, used least recently) to "
            f"keep prepared models within {cap / 1e9:g} GB ({CAP_ENV})."
        )


def _usage(folder: Path, files=None) -> int:
    total = 0
    for file in folder.iterdir() if files is None else files:
        with contextlib.suppress(OSError):
            total += file.stat().st_size
    return total


def _last_use(path: Path) -> float:
    """When a prepared model was last stored or mapped (``load`` touches it)."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _mb(size: int) -> str:
    if size < 1e5:  # a laid model's header and terms
        return f"{size / 1e3:.0f} kB"
    return f"{size / 1e6:.0f} MB" if size >= 1e7 else f"{size / 1e6:.1f} MB"


def _remove(path: Path) -> None:
    path.with_suffix(".json").unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def _sweep(path: Path, source: Path) -> None:
    """Record which file ``path`` prepares, and remove the prepared files of sources that are
    gone or changed since (a replaced model file, a test's temporary one), and forget those
    removed. An entry that is not
    a prepared file's name and a source path is dropped, never followed (a damaged index)."""
    index_path = path.parent / "index.json"
    index = {
        name: origin
        for name, origin in _read_index(index_path).items()
        if _NAME.fullmatch(name) and isinstance(origin, str) and origin
    }
    index[path.name] = str(source.resolve())
    for name, origin in list(index.items()):
        origin = Path(origin)
        try:
            stale = not origin.is_file() or path_for(origin).name != name
            stale = stale or not (path.parent / name).is_file()  # removed (the cap, --clear)
        except (OSError, ValueError):
            stale = True
        if stale:
            _remove(path.parent / name)
            del index[name]
    atomic_write(index_path, json.dumps(index, indent=1))


_NAME = re.compile(r"[0-9a-f]{24}\.pt")  # what path_for names a prepared file


def sources() -> dict[str, str]:
    """{prepared file's name: the model file it prepares}, as the index has them."""
    return _read_index(cache_dir() / "prepared" / "index.json")


def forget_removed() -> None:
    """The index without the prepared files removed (``constrained-spec cache --clear``), the
    folder gone with the last of them."""
    folder = cache_dir() / "prepared"
    index = {n: o for n, o in sources().items() if (folder / n).is_file()}
    with contextlib.suppress(OSError):
        if index:
            atomic_write(folder / "index.json", json.dumps(index, indent=1))
        else:
            (folder / "index.json").unlink(missing_ok=True)
            folder.rmdir()  # where nothing else is left in it


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    return index if isinstance(index, dict) else {}


def _state(module: nn.Module) -> dict:
    """A module as plain values and tensors (what ``torch.load(weights_only=True)`` reads)."""
    if isinstance(module, nn.Embedding):
        return {"class": "Embedding", "weight": _own(module.weight.data)}
    if isinstance(module, nn.ParameterList):
        return {"class": "ParameterList", "items": [_own(p.data) for p in module]}
    if isinstance(module, nn.ModuleList):
        return {"class": "ModuleList", "items": [_state(m) for m in module]}
    assert type(module).__name__ in _MODULES, type(module)
    return {
        "class": type(module).__name__,
        "parameters": {k: _own(p.data) for k, p in module._parameters.items()},
        "buffers": {
            k: None if _rebuilt(module, k) else _own(t) for k, t in module._buffers.items()
        },
        "modules": {k: _state(m) for k, m in module._modules.items()},
        # public plain attributes; objects (config, shape, caches) are rebuilt by start()
        "attributes": {
            k: _own(v) for k, v in vars(module).items() if not k.startswith("_") and _plain(v)
        },
    }


def _rebuilt(module: nn.Module, buffer: str) -> bool:
    """Whether a buffer is left out of the file, to be rebuilt where needed: a 4-bit linear's
    plain nibbles, which our kernels' tiles hold too (Int4Linear.stored_nibbles; 0.9 GB of a
    1.5B model's file, read only to re-lay or dequantize the weights)."""
    return (
        isinstance(module, kernels.Int4Linear) and buffer == "nibbles" and module.kernel != "torch"
    )


def _own(value):
    """A tensor that views a larger storage (a slice of a file's array) as a copy of its own:
    torch.save writes a tensor's whole storage. Tensors sharing one storage whole (tied
    embeddings) stay shared, stored once."""
    if isinstance(value, list | tuple):
        return type(value)(_own(v) for v in value)
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
        return value.clone()
    return value


def _restore(state: dict) -> nn.Module:
    kind = state["class"]
    if kind == "Embedding":
        return nn.Embedding.from_pretrained(state["weight"], freeze=True)
    if kind == "ParameterList":
        return nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in state["items"])
    if kind == "ModuleList":
        return nn.ModuleList(_restore(s) for s in state["items"])
    module = _MODULES[kind].__new__(_MODULES[kind])
    nn.Module.__init__(module)
    for k, t in state["parameters"].items():
        module.register_parameter(k, nn.Parameter(t, requires_grad=False))
    for k, t in state["buffers"].items():
        module.register_buffer(k, t)
    for k, s in state["modules"].items():
        module.add_module(k, _restore(s))
    for k, v in state["attributes"].items():
        setattr(module, k, v)
    return module


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


def _stored_bytes(state: dict) -> int:
    """What torch.save writes of the state's tensors: each storage once (a tied table's is in
    the state twice, as the embedding and the head's rows: counted twice, Gemma 2 2B's 3.3 GB
    file read as 4.1, over the default cap)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in _tensors(state)}
    return sum(storage.nbytes() for storage in storages.values())  # empty ones: at 0, 0 bytes


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
