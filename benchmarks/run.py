"""Masked speculative decoding vs the masked baseline vs peers: same requests, one process.

    python benchmarks/run.py --workload extract --n 40 --out benchmarks/results/<name>
    python benchmarks/run.py --quick --out /tmp/bench-quick          # tiny random model, seconds
    python benchmarks/run.py --report-only --out benchmarks/results/<name>   # redo report + plots

Every configuration runs on every request, interleaved (request i: all configurations, in an
order rotated by i, so machine noise and first-visit costs spread evenly). Before timing:
each configuration is warmed up once on an extra request, and each request gets one untimed
greedy baseline pass, which fills the mask cache of the states it visits and is the reference
for greedy identity. Timed: from chat messages in to token ids out, compile excluded (ours is
cached; the peers' processors are built before the clock starts).

Configurations (``--configs`` takes names, shell patterns such as 'int8*', or groups):
    baseline                     masked decoding, one target call per token
    forced, lookup               grammar-forced tokens; + grammar-aware prompt lookup
    int8/k{K}, int8/adaptive     int8 self-draft only (CompositeDrafter(DraftModel), no free drafts)
    int8+lookup/k{K}, .../adaptive   the default model_drafter: forced + lookup + int8 model
    bf16+lookup/k{K}, .../adaptive   the same with a bfloat16 copy of the target as draft
    head/k{K}                    the trained draft head only (constrained_spec/decoding/heads/; a random
                                 head with --quick)
    head+lookup/k{K}, .../adaptive   forced + lookup + the trained head
    head+lookup/k8/c{P}          the same, model drafting stopped once the chain's estimated
                                 chance of full acceptance falls below P (min_confidence)
    head+lookup/k8/c0.3/after-lookup   ablation: the head drafts after a lookup copy too
                                 (by default it does not)
    ...@t0.7                     the same at temperature 0.7 (seeded per request)
    baseline/torch-matmul, lookup/d3/torch-matmul   a 4-bit target on torch's int4 kernel
                                 instead of the one chosen by measurement (ours, where it runs)
    outlines                     outlines Generator (transformers model, outlines-core processor)
    hf+outlines                  transformers generate with that logits processor
    hf-assisted-lookup+outlines  + prompt_lookup_num_tokens=10
    hf-assisted-int8+outlines    + assistant_model = the int8 copy
    llama.cpp                    llama-cpp-python on the model's own GGUF (Q4_1 weights: not the
                                 fp32 copy the others run) with its JSON Schema grammar; optional
                                 (`pip install llama-cpp-python`, builds from source here)
Groups: all, engine, peers, greedy, sampled, default (= all).
Outputs under --out: requests.json, results.jsonl (one line per run, written as it goes),
results.json (everything, with the command line and machine), report.md, *.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fnmatch
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import report  # noqa: E402
import workloads  # noqa: E402
from workloads import Request, Selection  # noqa: E402

from constrained_spec import Generator  # noqa: E402
from constrained_spec.constraints import GuidanceConstraint  # noqa: E402
from constrained_spec.decoding.drafters import (  # noqa: E402
    CompositeDrafter,
    DraftModel,
    logits_width,
    model_drafter,
)
from constrained_spec.decoding.head import DraftHead, HeadDraft, load_head, shipped_head  # noqa: E402
from constrained_spec.model import kernels, kv  # noqa: E402
from constrained_spec.model.llama import CompactLlama, from_transformers  # noqa: E402
from constrained_spec.model.machine import cache_dir  # noqa: E402
from constrained_spec.model.models import (  # noqa: E402
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    WEIGHTS,
    describe_weights,
    load_model,
    quantize_int8,
    skinny_matmul,
    verified_gguf,
)
from constrained_spec.testing import NEAR_TIE, first_divergence  # noqa: E402

ENGINE_CLASSES = (GuidanceConstraint,)  # the constraint's per-state work, metered below

KS = (2, 3, 4, 7, 8)
CONFIDENCES = (0.1, 0.2, 0.3, 0.5, 0.7)  # early stops tried with the head at k = max(KS)
ADAPTIVE_K_MAX = 8
DRAFT_CAPS = (2, 3, 4, 5, 7, 11, 15)  # max_draft values tried (verify widths 3 to 16)
HOT_T = 0.7


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # engine | outlines | hf | hf-assisted | llama.cpp
    drafter: str | None = None  # forced | lookup | int8 | int8+lookup (hf-assisted: lookup | int8)
    k: int = 0  # engine: draft-model tokens per round (k_max when adaptive)
    adaptive: bool = False
    temperature: float = 0.0
    min_confidence: float = 0.0  # engine: CompositeDrafter.min_confidence (an early stop)
    after_lookup: bool = False  # engine: CompositeDrafter.model_after_lookup (an ablation)
    float_target: bool = False  # engine: the float32 transformers target, whatever --weights
    max_draft: int | None = None  # engine: CompositeDrafter.max_draft (None: its default)
    matmul: str | None = None  # engine: a 4-bit target's matmul kernel (None: the one chosen)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def peer(self) -> bool:
        return self.kind != "engine"


def all_configs() -> list[Config]:
    hot = lambda c: replace(c, name=f"{c.name}@t{HOT_T:g}", temperature=HOT_T)  # noqa: E731
    base = Config("baseline", "engine")
    base_float = Config("baseline-float", "engine", float_target=True)
    forced, lookup = Config("forced", "engine", "forced"), Config("lookup", "engine", "lookup")
    model = {
        d: [Config(f"{d}/k{k}", "engine", d, k) for k in KS]
        + [Config(f"{d}/adaptive", "engine", d, ADAPTIVE_K_MAX, adaptive=True)]
        for d in ("int8", "int8+lookup", "bf16+lookup", "head", "head+lookup")
    }
    k4 = lambda d: next(c for c in model[d] if c.k == 4)  # noqa: E731  (the sampled variants)
    model["head+lookup"] += [
        Config(f"head+lookup/k{KS[-1]}/c{c:g}", "engine", "head+lookup", KS[-1], min_confidence=c)
        for c in CONFIDENCES
    ]
    model["head+lookup"].append(
        Config(
            f"head+lookup/k{KS[-1]}/c0.3/after-lookup",
            "engine",
            "head+lookup",
            KS[-1],
            min_confidence=0.3,
            after_lookup=True,
        )
    )
    # draft-length caps: on the int4 target a verify's cost grows in steps of 4 tokens
    capped = [
        replace(c, name=f"{c.name}/d{d}", max_draft=d)
        for d in DRAFT_CAPS
        for c in (
            lookup,
            *(c for c in model["head+lookup"] if c.min_confidence == 0.3 and not c.after_lookup),
            Config("head+lookup/k4/c0.3", "engine", "head+lookup", 4, min_confidence=0.3),
        )
    ]
    # torch's 4-bit kernel in place of the one the calibration chose: the kernels side by side
    torch_matmul = [
        replace(c, name=f"{c.name}/torch-matmul", matmul="torch")
        for c in (base, next(c for c in capped if c.name == "lookup/d3"))
    ]
    peers = [
        Config("outlines", "outlines"),
        Config("hf+outlines", "hf"),
        Config("hf-assisted-lookup+outlines", "hf-assisted", "lookup"),
        Config("hf-assisted-int8+outlines", "hf-assisted", "int8"),
        Config("llama.cpp", "llama.cpp"),
    ]
    return (
        [
            base,
            base_float,
            forced,
            lookup,
            *model["int8"],
            *model["int8+lookup"],
            *model["bf16+lookup"],
            *model["head"][:-1],
            *model["head+lookup"],
        ]
        + capped
        + torch_matmul
        + [hot(c) for c in capped]
        + [
            hot(base),
            hot(base_float),
            hot(lookup),
            hot(k4("int8")),
            hot(k4("int8+lookup")),
            hot(model["int8+lookup"][-1]),
            hot(k4("head")),
            hot(k4("head+lookup")),
            *(hot(c) for c in model["head+lookup"] if c.min_confidence and not c.after_lookup),
        ]
        + peers
        + [hot(peers[1]), hot(peers[4])]
    )


def select_configs(spec: str) -> list[Config]:
    configs, chosen = all_configs(), []
    groups = {
        "all": lambda c: True,
        "default": lambda c: True,
        "engine": lambda c: not c.peer,
        "peers": lambda c: c.peer,
        "greedy": lambda c: c.greedy,
        "sampled": lambda c: not c.greedy,
    }
    for pattern in [p.strip() for p in spec.split(",") if p.strip()]:
        match = [
            c
            for c in configs
            if (groups[pattern](c) if pattern in groups else fnmatch.fnmatchcase(c.name, pattern))
        ]
        if not match:
            names = ", ".join(c.name for c in configs)
            raise SystemExit(
                f"--configs: {pattern!r} matches nothing. Names: {names}; "
                f"groups: {', '.join(groups)}."
            )
        chosen += [c for c in match if c not in chosen]
    if not any(c.name == "baseline" for c in chosen):  # speedups are relative to it
        chosen.insert(0, configs[0])
    hot_base = next(c for c in configs if c.name == f"baseline@t{HOT_T:g}")
    if any(not c.greedy for c in chosen) and hot_base not in chosen:
        chosen.append(hot_base)
    return sorted(chosen, key=configs.index)


# --- measurement helpers ------------------------------------------------------------------------


class Meter:
    """Counters shared by every run: target forwards (a hook) and time in the constraint's
    per-state work (METERED: masks for the target, the masks and forced text the drafters ask
    for; a call inside another metered call counts once)."""

    current: Meter | None = None

    def __init__(self, target):
        self.forwards, self.mask_s, self.mask_calls, self.depth = 0, 0.0, 0, 0
        self.mask_by: dict[str, float] = {}  # seconds by the outermost metered method
        self.hook = target.register_forward_pre_hook(self._count)
        Meter.current = self
        for cls in ENGINE_CLASSES:  # wrappers here, not a library change
            for name in METERED:
                if name in cls.__dict__ and f"_unmetered{name}" not in cls.__dict__:
                    setattr(cls, f"_unmetered{name}", cls.__dict__[name])
                    setattr(cls, name, _metered(cls.__dict__[name], name))

    def close(self) -> None:
        self.hook.remove()
        Meter.current = None
        for cls in ENGINE_CLASSES:
            for name in METERED:
                if f"_unmetered{name}" in cls.__dict__:
                    setattr(cls, name, cls.__dict__[f"_unmetered{name}"])
                    delattr(cls, f"_unmetered{name}")

    def _count(self, module, args):
        self.forwards += 1

    def reset(self) -> None:
        self.forwards, self.mask_s, self.mask_calls, self.depth = 0, 0.0, 0, 0
        self.mask_by = {}
        _reset_peak_rss()


# Every query of either engine's per-state work (their internals only ever run inside these):
# the masks, each step's legality test, forced tokens and text, spelling a copy. The same names
# in the code before the bitmask rows, so one meter times old and new alike.
METERED = (
    "mask",
    "masks",
    "step",
    "accepting",
    "forced",
    "forced_text",
    "tokenize",
    "legal_prefix",
)


def _metered(method, name: str):
    def metered(constraint, *args, **kwargs):
        meter = Meter.current
        if meter is None or meter.depth:
            return method(constraint, *args, **kwargs)
        meter.depth += 1
        t = time.perf_counter()
        try:
            return method(constraint, *args, **kwargs)
        finally:
            meter.depth -= 1
            spent = time.perf_counter() - t
            meter.mask_s += spent
            meter.mask_by[name] = meter.mask_by.get(name, 0.0) + spent
            if name in ("mask", "masks"):  # masks made: one, or a pass's
                meter.mask_calls += 1 if name == "mask" else len(args[0])

    return metered


def _reset_peak_rss() -> None:
    try:  # Linux: "5" resets VmHWM (the peak RSS) to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TimedProcessor:
    """Wraps a logits processor: time inside it, and when it is first called (≈ TTFT)."""

    def __init__(self, inner, start: float):
        self.inner, self.start = inner, start
        self.first_call_s, self.seconds, self.calls, self.prompt_len = None, 0.0, 0, None

    def reset(self) -> None:
        self.inner.reset()

    def __call__(self, input_ids, scores):
        t = time.perf_counter()
        if self.first_call_s is None:
            self.first_call_s, self.prompt_len = t - self.start, input_ids.shape[-1]
        try:
            return self.inner(input_ids, scores)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1


# --- runners: one request under one configuration -----------------------------------------------


class Bench:
    def __init__(self, args, model, tokenizer, configs):
        self.args, self.model, self.tokenizer = args, model, tokenizer
        self.gen = Generator(model, tokenizer, draft=None, open_objects=args.open_objects)
        self.budget_mask = not args.no_budget_mask  # replies finish within --max-new-tokens
        self.float_gen = self._float_gen(args) if any(c.float_target for c in configs) else None
        self.eos = self.gen.vocab.eos_id
        self._outlines = None  # outlines Transformers model, or the exception it raised
        self._indexes: dict = {}  # request id → outlines-core Index, or the exception
        self._llama = None  # llama_cpp.Llama, or the exception it raised
        self._drafters: dict = {}  # configuration name → its drafter
        self.int8 = None
        if any(c.drafter in ("int8", "int8+lookup") for c in configs):
            self.int8 = quantize_int8(model)  # before the meter's hook, which a copy would inherit
        self.bf16 = (
            copy.deepcopy(model).to(torch.bfloat16)
            if any(c.drafter == "bf16+lookup" for c in configs)
            else None
        )  # before the hook too
        if args.skinny_matmul:  # after the draft copies: they keep their own kernels
            skinny_matmul(model)
        self.head = (
            self._head(args, model)
            if any((c.drafter or "").startswith("head") for c in configs)
            else None
        )
        self.meter = Meter(model)

    def _float_gen(self, args):
        """The float32 transformers target next to a quantized one: the masked baseline as it
        ran before the compact forward."""
        if not isinstance(self.model, CompactLlama):
            return self.gen
        model = (
            workloads.tiny_model_and_tokenizer()[0]
            if args.quick
            else load_model(args.model, weights="float")[0]
        )
        return Generator(model, self.tokenizer, draft=None, open_objects=args.open_objects)

    def _head(self, args, model):
        if args.quick:  # the tiny model has no trained head: a random one exercises the path
            torch.manual_seed(0)
            return DraftHead.for_target(model, torch.arange(logits_width(model))).eval()
        return load_head(model, self.gen.vocab, shipped_head(args.model))

    def drafter(self, config: Config):
        """One drafter per configuration, kept across requests as a user's Generator keeps it
        (a draft KV cache that reuses a shared prompt prefix; what a drafter learns)."""
        if config.drafter is None:
            return None
        if config.name not in self._drafters:
            width, stop = self.gen.width, config.min_confidence
            drafter = {
                "forced": lambda: CompositeDrafter(model=None, use_lookup=False),
                "lookup": lambda: CompositeDrafter(model=None),
                "int8": lambda: CompositeDrafter(
                    DraftModel(self.int8, width), use_forced=False, use_lookup=False
                ),
                "int8+lookup": lambda: model_drafter(self.int8, width),
                "bf16+lookup": lambda: model_drafter(self.bf16, width),
                "head": lambda: CompositeDrafter(
                    HeadDraft(self.head, self.model),
                    use_forced=False,
                    use_lookup=False,
                    min_confidence=stop,
                ),
                "head+lookup": lambda: CompositeDrafter(
                    HeadDraft(self.head, self.model),
                    min_confidence=stop,
                    model_after_lookup=config.after_lookup,
                ),
            }[config.drafter]()
            if config.max_draft is not None:
                drafter.max_draft = config.max_draft
            self._drafters[config.name] = drafter
        return self._drafters[config.name]

    def run(self, config: Config, request: Request, seed: int, max_new_tokens: int) -> dict:
        row = {
            "config": config.name,
            "request": request.id,
            "seed": seed,
            "temperature": config.temperature,
            "prompt_tokens": request.prompt_tokens,
            "loadavg": os.getloadavg()[0],
        }
        try:
            runner = {"engine": self.run_engine, "llama.cpp": self.run_llama_cpp}.get(
                config.kind, self.run_peer
            )
            row.update(runner(config, request, seed, max_new_tokens))
            row["status"] = row.get("status", "ok")
        except Exception as e:  # a crash is a result, recorded as such
            row.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
        row["rss_peak_mb"] = peak_rss_mb()
        return row

    def run_engine(self, config, request, seed, max_new_tokens) -> dict:
        drafter = self.drafter(config)
        gen = self.float_gen if config.float_target else self.gen
        with self.matmul(config.matmul):
            return self._timed_generate(gen, config, request, seed, max_new_tokens, drafter)

    @contextlib.contextmanager
    def matmul(self, kernel: str | None):
        """The 4-bit target on ``kernel`` (kernels.INT4_KERNELS) for one run (repacked outside
        the clock), then back on the chosen one; None leaves it as chosen."""
        chosen = getattr(self.model, "matmul", None)
        if kernel is None or chosen is None:
            yield
            return
        self.model.use_matmul(kernel)
        try:
            yield
        finally:
            self.model.use_matmul(chosen)

    def _timed_generate(self, gen, config, request, seed, max_new_tokens, drafter) -> dict:
        speculative = drafter is not None
        self.meter.reset()
        forget_prompts(gen.target)  # configs run the same prompts: each one computes its own
        t0 = time.perf_counter()
        result = gen.generate(
            request.messages,
            schema=request.schema,
            max_new_tokens=max_new_tokens,
            temperature=config.temperature,
            seed=seed,
            num_draft_tokens=max(config.k, 1),
            speculative=speculative,
            adaptive_k=config.adaptive,
            drafter=drafter,
            budget_mask=self.budget_mask,
        )
        wall = time.perf_counter() - t0
        s, n = result.stats, len(result.token_ids)
        return {
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "output_tokens": n,
            "wall_s": wall,
            "decode_s": s.total_s,
            "ttft_s": s.ttft_s,
            "tpot_s": (s.total_s - s.ttft_s) / (n - 1) if n > 1 else None,
            "prefill_s": s.prefill_s,
            "gen_s": s.total_s - s.prefill_s,
            "draft_s": s.draft_s,
            "verify_s": s.verify_s,
            "mask_s": self.meter.mask_s,
            "mask_by": dict(self.meter.mask_by),
            "mask_calls": self.meter.mask_calls,
            "target_calls": s.target_calls,
            "forward_calls": self.meter.forwards,
            "committed_tokens": n + (result.finish_reason != "length"),
            "drafted": s.drafted,
            "accepted": s.accepted,
            "accepted_by_position": s.accepted_by_position,
            "drafted_by_position": s.drafted_by_position,
            "drafted_by_source": s.drafted_by_source,
            "accepted_by_source": s.accepted_by_source,
            "accepted_lengths": s.accepted_lengths,
        }

    # peers -----------------------------------------------------------------------------------

    def outlines_index(self, request: Request):
        """outlines' own regex (build_regex_from_schema, compact whitespace) compiled by
        outlines-core with outlines' vocabulary, bounded like ours; built before timing."""
        if request.id not in self._indexes:
            try:
                from outlines.backends.outlines_core import OutlinesCoreBackend
                from outlines_core import Index
                from outlines_core.json_schema import build_regex_from_schema

                model = self.outlines_model()
                vocabulary = getattr(self, "_outlines_vocab", None)
                if vocabulary is None:
                    vocabulary = self._outlines_vocab = OutlinesCoreBackend(model).vocabulary
                regex = build_regex_from_schema(json.dumps(request.schema), "")
                t = time.perf_counter()
                index = Index(regex, vocabulary)
                self._indexes[request.id] = (index, time.perf_counter() - t)
            except Exception as e:
                self._indexes[request.id] = (e, None)
        return self._indexes[request.id]

    def outlines_model(self):
        def load():
            import outlines

            return outlines.from_transformers(self.model, self.tokenizer)

        return self._load_once("_outlines", load, Exception)

    def run_peer(self, config, request, seed, max_new_tokens) -> dict:
        try:
            from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor
        except ImportError as e:
            return {"status": "unavailable", "error": f"{type(e).__name__}: {e}"}
        index, compile_s = self.outlines_index(request)
        if isinstance(index, Exception):
            return {
                "status": "error",
                "error": f"outlines compile: {type(index).__name__}: {str(index)[:300]}",
            }
        sampling = (
            {"do_sample": False}
            if config.greedy
            else {"do_sample": True, "temperature": config.temperature, "top_k": 0, "top_p": 1.0}
        )
        sampling.update(max_new_tokens=max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos)
        if config.kind == "hf-assisted":
            sampling.update(
                {"prompt_lookup_num_tokens": 10}
                if config.drafter == "lookup"
                else {"assistant_model": self.int8}
            )
        torch.manual_seed(seed)  # transformers samples from the global generator
        self.meter.reset()
        t0 = time.perf_counter()
        processor = TimedProcessor(OutlinesCoreLogitsProcessor(index, "torch"), t0)
        if config.kind == "outlines":
            prompt_len, new = self._outlines_generate(request, processor, sampling)
        else:
            prompt_len, new = self._hf_generate(request, processor, sampling)
        wall = time.perf_counter() - t0
        stop = self.eos in new
        ids = new[: new.index(self.eos)] if stop else new
        n, forwards = len(ids), self.meter.forwards
        ttft = processor.first_call_s
        return {
            "token_ids": ids,
            "text": self.gen.vocab.decode(ids),
            "finish_reason": "stop" if stop else "length",
            "output_tokens": n,
            "peer_prompt_tokens": prompt_len,
            "wall_s": wall,
            "decode_s": wall,
            "ttft_s": ttft,
            "gen_s": wall - ttft if ttft is not None else None,
            "tpot_s": (wall - ttft) / (n - 1) if n > 1 and ttft is not None else None,
            "mask_s": processor.seconds,
            "mask_calls": processor.calls,
            "target_calls": forwards,
            "forward_calls": forwards,
            "committed_tokens": n + stop,
            "peer_compile_s": compile_s,
        }

    def llama_cpp(self):
        """The model's GGUF (``--model``'s file, or the built-in model's own) in llama.cpp,
        threads as torch's; loaded once."""

        def load():
            from llama_cpp import Llama

            model = self.args.model  # a GGUF file, or the built-in model's own
            gguf = (
                model
                if model.endswith(".gguf")
                else verified_gguf(BUILTIN_MODELS[model], cache_dir() / model)
            )
            return Llama(
                str(gguf),
                n_ctx=4096,
                n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(),
                verbose=False,
            )

        return self._load_once(
            "_llama", load, (ImportError, KeyError, OSError, ValueError, RuntimeError)
        )

    def _load_once(self, attr: str, load, errors):
        """``load()`` on first use, kept in ``attr``; a failure (one of ``errors``) is kept too
        and raised again on every later call, so a missing peer costs one attempt."""
        if getattr(self, attr) is None:
            try:
                setattr(self, attr, load())
            except errors as e:
                setattr(self, attr, e)
        if isinstance(getattr(self, attr), Exception):
            raise getattr(self, attr)
        return getattr(self, attr)

    def run_llama_cpp(self, config, request, seed, max_new_tokens) -> dict:
        try:
            from llama_cpp import LlamaGrammar

            llm = self.llama_cpp()
        except (ImportError, KeyError) as e:
            return {"status": "unavailable", "error": f"{type(e).__name__}: {e}"}
        t = time.perf_counter()  # its grammar is built before the clock, like outlines' index
        grammar = LlamaGrammar.from_json_schema(json.dumps(request.schema), verbose=False)
        compile_s = time.perf_counter() - t
        text = chat_text(self.tokenizer, request.messages)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)  # the GGUF's own vocabulary
        sampling = (
            {"temp": 0.0}
            if config.greedy
            else {"temp": config.temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        )
        llm.reset()  # no KV reuse from the previous request: the same footing as the others
        llm.set_seed(seed)
        new, ttft = [], None
        t0 = time.perf_counter()
        for token in llm.generate(prompt, grammar=grammar, repeat_penalty=1.0, **sampling):
            if ttft is None:
                ttft = time.perf_counter() - t0
            new.append(token)
            if token == self.eos or len(new) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        stop = self.eos in new
        ids = new[: new.index(self.eos)] if stop else new
        n = len(ids)
        return {
            "token_ids": ids,
            "text": self.gen.vocab.decode(ids),
            "finish_reason": "stop" if stop else "length",
            "output_tokens": n,
            "peer_prompt_tokens": len(prompt),
            "wall_s": wall,
            "decode_s": wall,
            "ttft_s": ttft,
            "gen_s": wall - ttft if ttft is not None else None,
            "tpot_s": (wall - ttft) / (n - 1) if n > 1 and ttft is not None else None,
            "target_calls": n + stop,
            "forward_calls": n + stop,
            "committed_tokens": n + stop,
            "peer_compile_s": compile_s,
        }

    def _hf_generate(self, request, processor, sampling):
        from transformers import LogitsProcessorList

        text = chat_text(self.tokenizer, request.messages)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                logits_processor=LogitsProcessorList([processor]),
                **sampling,
            )
        return len(ids), out[0, len(ids) :].tolist()

    def _outlines_generate(self, request, processor, sampling):
        from outlines.generator import SteerableGenerator
        from outlines.inputs import Chat

        model = self.outlines_model()
        # outlines returns decoded text; keep its ids instead (token counts must be exact)
        model._decode_generation = lambda generated: generated  # noqa: SLF001
        try:
            generator = SteerableGenerator.from_processor(model, processor)
            with torch.inference_mode():
                new = generator(Chat(request.messages), **sampling)
        finally:
            del model._decode_generation
        return processor.prompt_len, new.reshape(-1).tolist()


# --- forward costs, measured apart from the decode loop ----------------------------------------


@torch.inference_mode()
def forward_ms(model, context: list[int], n: int, reps: int) -> list[float]:
    """ms of ``reps`` + 1 forwards over the last n tokens of ``context``, each after the rest
    is cached. The first is a warm-up (or, under torch.compile, the compilation)."""
    cache = kv.new_cache(model)
    kv.forward(model, cache, context, "cpu")
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        kv.forward(model, cache, context[-n:], "cpu")
        times.append(1e3 * (time.perf_counter() - t))
        kv.crop(cache, len(context))
    return times


@torch.inference_mode()
def calibrate(target, draft, context: list[int], reps: int = 10) -> dict:
    """ms of one target forward over n new tokens (n = 1, 2, 3, 5, 9, 17: a verify of k = n − 1
    drafts) and of one draft-model step, after ``context`` is cached: the c and verify-cost
    curve the speedup prediction needs, free of loop overhead and of the draft's prefill."""

    def step_ms(model, n: int) -> float:
        return statistics.median(forward_ms(model, context, n, reps)[1:])

    out = {
        "context_tokens": len(context),
        "target_ms": {n: step_ms(target, n) for n in (1, 2, 3, 4, 5, 8, 9, 17)},
        **bandwidth_limit(target, lambda: step_ms(target, 1)),
    }
    if draft is not None:
        out["draft_step_ms"] = step_ms(draft, 1)
        t = time.perf_counter()
        kv.forward(draft, kv.new_cache(draft), context, "cpu")
        out["draft_prefill_ms"] = 1e3 * (time.perf_counter() - t)
        out["cost_ratio"] = out["draft_step_ms"] / out["target_ms"][1]
    return out


PREFILL_ONLY = ("nibbles", "scale_rows", "offset_rows")  # kernels.Int4Linear's prefill buffers


def bandwidth_limit(target, step_ms=None, rounds: int = 7) -> dict:
    """The one-token step's floor on this machine: the bytes of weights a step reads (every
    parameter and buffer but the input embedding's rows, which are looked up, and the 4-bit
    linears' prefill-only buffers) over the memory read bandwidth (summing a 1 GiB tensor).
    With ``step_ms`` (the median ms of a one-token step), ``rounds`` rounds of one sum and one
    step measurement each, so that both see the same machine (a shared one's bandwidth moves
    by a fifth from minute to minute): the medians of the bandwidth, the step and their ratio."""
    named = [*target.named_parameters(), *target.named_buffers()]
    tensors = {t.data_ptr(): t for name, t in named if not name.endswith(PREFILL_ONLY)}
    head = target.get_output_embeddings()
    streamed = getattr(head, "weight", None)  # a float head's rows (a Q8Head reads its blocks)
    gathered = [*target.get_input_embeddings().state_dict().values()]  # the fed tokens' rows
    if isinstance(head, kernels.Q8Head):
        gathered += head.table.state_dict().values()  # the few rows recomputed in float32
    for t in gathered:
        if streamed is None or t.data_ptr() != streamed.data_ptr():  # tied to a float head: read
            tensors.pop(t.data_ptr(), None)
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    big = torch.ones(2**28)  # 1 GiB of float32
    big.sum()  # the first sum also faults the pages in
    limits, steps = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        big.sum()
        limits.append(weight_bytes / (big.numel() * 4) * (time.perf_counter() - t) * 1e3)
        if step_ms is not None:
            steps.append(step_ms())
    del big
    # medians: the best of a few sums once read 81 GB/s on a machine whose sums read 48-50
    limit = statistics.median(limits)
    out = {
        "weight_bytes": weight_bytes,
        "read_gb_s": weight_bytes / limit / 1e6,
        "bandwidth_limit_ms": limit,
    }
    if steps:
        ratios = [step / floor for step, floor in zip(steps, limits)]
        out |= {"step_ms": statistics.median(steps), "step_over_limit": statistics.median(ratios)}
        out |= {"step_over_limit_range": [min(ratios), max(ratios)]}
    return out


# --- correctness fields ------------------------------------------------------------------------


def chat_text(tokenizer, messages: list[dict] | str) -> str:
    """A peer's prompt text: the chat template applied, or the plain text of a base model."""
    if isinstance(messages, str):
        return messages
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def divergence_gap(gen, request: Request, reference: list[int], other: list[int]) -> tuple:
    """(first index where two greedy outputs differ, the reference's top-2 masked logit gap
    there); (None, None) if identical."""
    if reference == other:
        return None, None
    constraint = gen.compile(schema=request.schema)
    return first_divergence(
        gen.target, constraint, gen.encode_prompt(request.messages), reference, other
    )


def judge(row: dict, request: Request, config: Config, reference: dict | None, gen) -> None:
    """Adds validity, exact match (extract) and greedy identity with the baseline."""
    if row.get("status") != "ok":
        return
    try:
        value = json.loads(row["text"])
        parsed = True
    except ValueError:
        value, parsed = None, False
    row["valid"] = (
        parsed and row["finish_reason"] != "length" and workloads.is_valid(request.schema, value)
    )
    if request.expected is not None:  # scored as benchmarks/quality.py scores: cut is wrong
        got = value if row["valid"] else workloads.MISSING
        row["exact_match"] = row["valid"] and workloads.same(value, request.expected)
        row["leaves_right"], row["leaves"] = workloads.leaves_right(request.expected, got)
    if not config.greedy or reference is None:
        row["identical"] = None
        return
    if config.peer or config.float_target:  # other weights (or another tokenization of the
        row["identical"] = row["text"] == reference["text"]  # same text): compare texts
        return
    row["identical"] = row["token_ids"] == reference["token_ids"]
    if not row["identical"]:
        index, gap = divergence_gap(gen, request, reference["token_ids"], row["token_ids"])
        row.update(
            first_divergence=index, divergence_gap=gap, near_tie=gap is not None and gap < NEAR_TIE
        )


# --- the run -----------------------------------------------------------------------------------


def forget_prompts(target) -> None:
    """Empty the target's kept prompts (llama.PromptCache), where it keeps any: a timed request
    then computes its whole prompt, as it would the first time."""
    if getattr(target, "prompt_cache", None) is not None:
        target.prompt_cache.clear()


def machine_info(args) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": os.getloadavg(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        )
        info["avx512_bf16"] = "avx512_bf16" in cpuinfo
        flags = set(next(ln for ln in cpuinfo.splitlines() if ln.startswith("flags")).split())
        info["cpu_flags"] = [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags
        ]
    except (OSError, StopIteration):
        pass
    info["isa"] = getattr(args, "isa", None)  # what our kernels and torch may use (--isa)
    info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    with contextlib.suppress(Exception):  # llama.cpp runs what it was built for
        import llama_cpp

        info["llama_cpp_system"] = llama_cpp.llama_print_system_info().decode().strip()
    for name in ("transformers", "outlines", "outlines_core", "jsonschema", "llama_cpp_python"):
        try:
            from importlib.metadata import version

            info[name] = version(name)
        except Exception:
            info[name] = None
    try:
        git = lambda *a: subprocess.run(
            ["git", "-C", str(ROOT), *a],
            capture_output=True,  # noqa
            text=True,
            timeout=10,
        ).stdout.strip()
        info["git_commit"] = git("rev-parse", "HEAD")
        info["git_dirty"] = bool(git("status", "--porcelain"))
    except Exception:
        pass
    return info


def load(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:  # the tiny model quantized as a Llama-family model would be
        model, tokenizer = workloads.tiny_model_and_tokenizer()
        return (
            model if args.weights in ("auto", "float") else from_transformers(model, args.weights)
        ), tokenizer
    return load_model(args.model, weights=args.weights)


# --isa: the environment it runs under (read by torch at import, by the kernel library's choice)
ISAS = {
    "native": {},
    "avx2": {"CONSTRAINED_SPEC_KERNELS": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2"},
}


def main(argv=None) -> int:
    args = parse_args(argv)
    if any(os.environ.get(k) != v for k, v in ISAS[args.isa].items()):  # torch is imported
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ISAS[args.isa]})
    out = Path(args.out)
    if args.report_only:
        report.write(json.loads((out / "results.json").read_text()), out)
        print(f"report: {out / 'report.md'}")
        return 0
    configs = select_configs(args.configs)
    out.mkdir(parents=True, exist_ok=True)
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    say(f"loading {'the tiny random model' if args.quick else args.model} ...")
    model, tokenizer = load(args)
    bench = Bench(args, model, tokenizer, configs)
    try:
        return measure(args, configs, bench, out, argv, say)
    finally:
        bench.meter.close()


def measure(args, configs, bench, out: Path, argv, say) -> int:
    sel = Selection(
        args.seed,
        args.max_schema_chars,
        args.min_instance_chars,
        args.max_instance_chars,
        args.max_prompt_tokens,
    )
    say(f"selecting {args.n} {args.workload} requests from {args.data} ...")
    t = time.perf_counter()
    requests, skipped = workloads.select_requests(
        bench.gen, args.workload, args.n, sel, Path(args.data), log=say
    )
    say(
        f"  {len(requests) - 1} requests (+1 warm-up) in {time.perf_counter() - t:.1f} s; "
        f"skipped: {skipped}"
    )
    if len(requests) < 2:
        raise SystemExit("no usable requests: loosen --max-schema-chars / --max-instance-chars.")
    warmup, requests = requests[0], requests[1:]
    (out / "requests.json").write_text(
        json.dumps(
            {
                "selection": asdict(sel),
                "warmup": warmup.to_json(),
                "skipped": skipped,
                "requests": [r.to_json() for r in requests],
            },
            indent=1,
            ensure_ascii=False,
        )
    )
    meta = {
        "command": shlex.join([sys.executable, *sys.argv])
        if argv is None
        else shlex.join(["benchmarks/run.py", *argv]),
        "args": vars(args),
        "machine": machine_info(args),
        "started": time.time(),
        "model": "tiny random (quick)" if args.quick else args.model,
        "configs": [asdict(c) for c in configs],
        "near_tie": NEAR_TIE,
        "weights": describe_weights(
            args.model, args.weights, getattr(bench.model, "weights", "float"), bench.model
        )
        if not args.quick
        else args.weights,
    }

    if args.calibrate:
        say("measuring forward costs ...")
        meta["calibration"] = calibrate(
            bench.model, bench.int8, bench.gen.encode_prompt(warmup.messages)
        )
        say(f"  {json.dumps(meta['calibration'])}")
    say(f"warming up {len(configs)} configurations ...")
    for config in configs:
        row = bench.run(config, warmup, args.seed, min(args.max_new_tokens, 32))
        if row["status"] != "ok":
            say(f"  {config.name}: {row['status']} {row.get('error', '')[:200]}")
    rows: list[dict] = []
    jsonl = (out / "results.jsonl").open("w")
    for i, request in enumerate(requests):
        seed = args.seed * 100003 + i
        reference = bench.run(configs[0], request, seed, args.max_new_tokens)  # untimed
        if reference["status"] != "ok":
            reference = None
        order = configs[i % len(configs) :] + configs[: i % len(configs)]
        for config in order:
            row = bench.run(config, request, seed, args.max_new_tokens)
            judge(row, request, config, reference, bench.gen)
            rows.append(row)
            jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
            jsonl.flush()
        done = [r for r in rows if r["request"] == request.id and r["status"] == "ok"]
        say(
            f"[{i + 1}/{len(requests)}] {request.id} {request.file}: "
            + "  ".join(f"{r['config']}={r['output_tokens'] / r['wall_s']:.1f}" for r in done)
            + " tok/s"
        )
        # after every request, so that a run cut short still has a report (--report-only)
        results = save(out, meta, warmup, skipped, requests[: i + 1], rows)
        gc.collect()
    jsonl.close()
    meta["partial"] = False
    results = save(out, meta, warmup, skipped, requests, rows)
    report.write(results, out)
    say(f"results: {out / 'results.json'}\nreport:  {out / 'report.md'}")
    return 0


def save(out: Path, meta: dict, warmup, skipped, requests, rows) -> dict:
    meta.update(finished=time.time(), partial=meta.get("partial", True))
    meta["machine"]["loadavg_end"] = os.getloadavg()
    results = {
        "meta": meta,
        "warmup": warmup.to_json(),
        "skipped": skipped,
        "requests": [r.to_json() for r in requests],
        "results": rows,
    }
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, ensure_ascii=False))
    os.replace(tmp, out / "results.json")
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="extract")
    p.add_argument("--n", type=int, default=None, help="requests (default 40; 2 with --quick)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--configs", default="default", help="comma-separated names/patterns/groups")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--open-objects",
        action="store_true",
        help="Generator(open_objects=True): undeclared properties where the schema allows them "
        "(requests are selected with the same setting; the verdict cache may carry them over)",
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=list(WEIGHTS),
        help="the target's weights for every engine configuration but "
        "baseline-float (default: auto, as Generator.from_pretrained)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256 (64 with --quick)")
    p.add_argument(
        "--no-budget-mask", action="store_true", help="ours may be cut at --max-new-tokens too"
    )
    p.add_argument("--seed", type=int, default=0, help="selects the requests; seeds T>0 sampling")
    p.add_argument(
        "--data",
        default=str(workloads.DATA),
        help="JSONSchemaBench-style folder (default: the committed 48-file sample; the "
        "reports use the full dev set)",
    )
    p.add_argument("--max-schema-chars", type=int, default=None, help="default 1500 (500 quick)")
    p.add_argument("--min-instance-chars", type=int, default=20)
    p.add_argument("--max-instance-chars", type=int, default=None, help="default 300 (120 quick)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's own; 1 with --quick). On a shared "
        "2-core machine 2 threads can be 10x slower than 1: check first",
    )
    p.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="skip measuring target/draft forward costs (a few seconds)",
    )
    p.add_argument(
        "--skinny-matmul",
        action="store_true",
        help="the target computes 2-32-token inputs as W·xᵀ (models.SkinnyLinear): "
        "cheaper verify passes on CPU; the baseline uses the same model",
    )
    p.add_argument(
        "--isa",
        choices=list(ISAS),
        default="native",
        help="the instruction sets our kernels and torch may use: native (this CPU's), or avx2 "
        "(as on an AVX2-only laptop, on a CPU with more: the fused layers built for haswell into "
        "their own cache entry, torch held to AVX2). llama.cpp runs as it was built: the report "
        "gives its system info",
    )
    p.add_argument("--quick", action="store_true", help="tiny random model, a few requests")
    p.add_argument("--report-only", action="store_true", help="rebuild report from results.json")
    args = p.parse_args(argv)
    q = args.quick
    args.threads = args.threads or (1 if q else None)  # tiny model: threads only add overhead
    args.n = args.n if args.n is not None else (2 if q else 40)
    args.max_new_tokens = args.max_new_tokens or (64 if q else 256)
    args.max_schema_chars = args.max_schema_chars or (500 if q else 1500)
    args.max_instance_chars = args.max_instance_chars or (120 if q else 300)
    return args


if __name__ == "__main__":
    sys.exit(main())
