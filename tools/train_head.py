"""Train the draft head (constrained_spec/decoding/head.py) for the default model, on this CPU, seeded.

    python tools/train_head.py --out constrained_spec/decoding/heads/smollm2-135m-instruct.safetensors \
        --features /tmp/head-features.pt --answers target --dataset-tokens 800000 \
        --train-steps 3 --minutes 60 --train-tokens 150000

1. Data: chat prompts from JSONSchemaBench-dev (the two benchmark prompt forms, extract and
   generate). Files the benchmark may draw its requests from (the first --reserve files of its
   seeded order) are left out; the rest split by file name into train and validation. Each prompt
   is answered by the target itself, masked greedy under its schema (--answers target:
   self-distillation, what the head reads when drafting), or by a valid instance of the schema
   (--answers dataset). --dataset-tokens adds teacher-forced dataset answers to the
   self-distilled training set: 15× cheaper to collect, and the target's features and
   distributions there are as true.
2. Features: the target's LM-head inputs over each whole sequence, kept fp16.
3. Training: the head reads (f_i, embeddings of x_{i+1} and of its copy proposals: what followed
   the same bigram and token earlier in the sequence) and predicts f_{i+1}; loss = smooth-L1
   feature regression + distillation of the target's next-token distribution over the
   sub-vocabulary (--prompt-vocab: plus the sequence's prompt tokens, as drafting does; the
   logits are W_sub f_{i+1}: no need to store them), on every position
   (--loss-on answer: answers only; that overfits). --train-steps unrolls several draft steps,
   each reading the previous step's outputs (EAGLE-3's training-time test).
   --copy-gate opens and trains the copy gate: the distillation is then to the mixture
   q = π₀ softmax + Σ πₙ one-hot(copy proposal n), as drafting draws it (--gate-only: the gate
   alone, the rest frozen; minutes).
   The decoder layer starts as a copy of the target's last layer (--init: from a trained head).
   Noise on the input features stands in for the head's own, imperfect, predictions.
4. Report: on validation, how often the head's top token (sub-vocabulary) is the target's top
   token after 1, 2 and 3 draft steps, and the cost of one draft step vs one target step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "benchmarks")]  # the package, workloads.py

from workloads import DEV_SET, compact, is_valid, messages_for  # noqa: E402

from constrained_spec.constraints.vocabulary import token_vocabulary  # noqa: E402
from constrained_spec.decoding.drafters import logits_width  # noqa: E402
from constrained_spec.decoding.head import (  # noqa: E402
    DraftHead,
    HeadCache,
    copy_proposals,
    draft_vocabulary,
    load_head,  # noqa: E402
    pair_embeddings,
    unrolled,
    vocabulary_positions,
)
from constrained_spec.model import kv  # noqa: E402
from constrained_spec.model.models import DEFAULT_MODEL, load_model  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, help="weights path (.safetensors; card .json)")
    p.add_argument(
        "--evaluate",
        type=Path,
        metavar="HEAD",
        help="no training: print HEAD's validation agreement and step cost as JSON",
    )
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", type=Path, default=DEV_SET, help="the full dev set (not the sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reserve",
        type=int,
        default=400,
        help="first files of the benchmark's seeded order, left out of training",
    )
    p.add_argument("--train-tokens", type=int, default=200_000, help="target tokens to encode")
    p.add_argument("--val-tokens", type=int, default=20_000)
    p.add_argument("--max-schema-chars", type=int, default=1000)
    p.add_argument("--max-answer-chars", type=int, default=800)
    p.add_argument("--sub-vocab", type=int, default=8192, help="draft sub-vocabulary size")
    p.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--cls-weight", type=float, default=1.0)
    p.add_argument(
        "--reg-weight",
        type=float,
        default=1.0,
        help="weight of the feature regression (0: token loss only, as in EAGLE-3)",
    )
    p.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        help="loss weight of positions that predict an answer token, relative to "
        "prompt positions (what drafting is for, next to the most data)",
    )
    p.add_argument(
        "--prompt-vocab",
        action="store_true",
        help="distil over the sub-vocabulary plus the sequence's prompt tokens, as "
        "drafting does: rare words of a schema's descriptions come back in answers",
    )
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        metavar="HEAD",
        help="start from a trained head (its sub-vocabulary) instead of the target's last layer",
    )
    p.add_argument(
        "--copy-gate",
        action="store_true",
        help="open and train the copy gate (q mixes in the copy proposals)",
    )
    p.add_argument(
        "--gate-only",
        action="store_true",
        help="train the copy gate alone, the rest of the head frozen (with --init)",
    )
    p.add_argument(
        "--train-steps",
        type=int,
        default=1,
        help="draft steps unrolled in training, each reading the previous step's "
        "output (1 = EAGLE-1: true features only)",
    )
    p.add_argument("--noise", type=float, default=0.1, help="input feature noise, × feature std")
    p.add_argument(
        "--loss-on",
        choices=("all", "answer"),
        default="all",
        help="positions that carry the loss: every one (prompts are JSON Schemas and "
        "records: more data in the same domain) or the answers only",
    )
    p.add_argument(
        "--features",
        type=Path,
        default=None,
        help="cache file for the collected features (reused when present)",
    )
    p.add_argument(
        "--answers",
        choices=("dataset", "target"),
        default="dataset",
        help="answer each prompt with a valid instance from the dataset, or with the "
        "target's own masked greedy output (self-distillation: what the head reads "
        "when drafting)",
    )
    p.add_argument(
        "--dataset-tokens",
        type=int,
        default=0,
        help="--answers target: also train on this many tokens of teacher-forced "
        "dataset answers (the target's features and distributions are as true there; "
        "collecting runs at ~440 tok/s against ~28 for generation); cached next to "
        "--features as <name>.dataset.pt",
    )
    p.add_argument("--batch", type=int, default=16, help="--answers target: prompts per batch")
    p.add_argument("--max-new-tokens", type=int, default=192, help="--answers target: answer cap")
    return p.parse_args(argv)


# --- 1. data -------------------------------------------------------------------------------------


def dataset_files(args) -> tuple[list[Path], list[Path]]:
    files = sorted(args.data.glob("*.json"))
    order = files[:]
    random.Random(0).shuffle(order)  # the benchmark's order (workloads.select_requests, seed 0)
    reserved = {p.name for p in order[: args.reserve]}
    rest = [p for p in files if p.name not in reserved]
    val = [p for p in rest if int(hashlib.sha256(p.name.encode()).hexdigest(), 16) % 10 == 0]
    train = [p for p in rest if p not in set(val)]
    random.Random(args.seed).shuffle(train)
    return train, val


def sequences(files: list[Path], tokenizer, args, budget: int, with_schema: bool = False):
    """(token ids, index of the first answer token[, schema]) until ``budget`` tokens."""
    total = 0
    for path in files:
        try:
            entry = json.loads(path.read_text())
        except ValueError:
            continue
        schema = entry.get("schema")
        if not isinstance(schema, dict) or len(compact(schema)) > args.max_schema_chars:
            continue
        answers = [
            t["data"]
            for t in entry.get("tests", [])
            if t.get("valid") and 2 <= len(compact(t["data"])) <= args.max_answer_chars
        ]
        answers = [a for a in answers if is_valid(schema, a)]
        if not answers:
            continue
        answer = max(answers, key=lambda a: len(compact(a)))  # longest: most answer positions
        workload = ("extract", "generate")[
            int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 2
        ]
        text = tokenizer.apply_chat_template(
            messages_for(workload, schema, answer), add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer.encode(text, add_special_tokens=False)
        ids = (
            prompt
            + tokenizer.encode(compact(answer), add_special_tokens=False)
            + [tokenizer.eos_token_id]
        )
        if len(ids) > 1500:
            continue
        yield (ids, len(prompt), schema) if with_schema else (ids, len(prompt))
        total += len(ids)
        if total >= budget:
            return


@torch.inference_mode()
def collect(target, tokenizer, files, args, budget, say, skip: int = 0):
    """Target features (fp16) for each sequence after the first ``skip`` (already collected):
    [(ids, answer start, features (n, d))]."""
    out, tokens, t0 = [], 0, time.perf_counter()
    decoder = target.get_decoder()
    for i, (ids, start) in enumerate(sequences(files, tokenizer, args, budget)):
        if i < skip:
            continue
        x = torch.tensor([ids])
        h = decoder(input_ids=x).last_hidden_state[0]  # = the LM head's input (checked below)
        if i == skip:
            _, hooked = kv.forward(target, kv.new_cache(target), ids, "cpu", features=True)
            assert torch.allclose(h, hooked, atol=1e-4), "decoder output is not the LM head input"
        out.append((ids, start, h.half()))
        tokens += len(ids)
        if len(out) % 50 == 0:
            say(
                f"  {len(out)} sequences, {tokens} tokens, {tokens / (time.perf_counter() - t0):.0f} tok/s"
            )
    return out


@torch.inference_mode()
def self_distilled(target, tokenizer, files, args, budget, say):
    """The same prompts answered by the target itself, masked greedy as at run time, in batches
    (left-padded): [(ids, answer start, features (n, d))]. Features come from the generation
    passes themselves; the last token (EOS or the cap) has none and is left out."""
    from transformers import LogitsProcessor

    from constrained_spec import ConstraintError, Generator
    from constrained_spec.constraints import FINISHED
    from constrained_spec.model.models import skinny_matmul

    skinny_matmul(target)  # a batch step feeds --batch rows: W·xᵀ streams the weights once
    gen = Generator(target, tokenizer)  # its compile: schema → regex → cached constraint
    eos = gen.vocab.eos_id

    def compiled(job):  # each compile runs in a forked child: two threads keep both cores busy
        ids, start, schema = job
        try:
            return ids[:start], gen.compile(schema=schema)
        except (ConstraintError, ValueError):  # refused, too complex, unsatisfiable: skipped
            return None

    todo = list(sequences(files, tokenizer, args, budget, with_schema=True))
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        jobs = [j for j in pool.map(compiled, todo) if j is not None]  # (prompt ids, constraint)
    say(f"  {len(jobs)} of {len(todo)} prompts compiled")

    class Masked(LogitsProcessor):
        def __init__(self, constraints):
            self.constraints, self.states = constraints, None  # None: nothing generated yet

        def __call__(self, input_ids, scores):
            first = self.states is None
            if first:
                self.states = [c.initial_state for c in self.constraints]
            out = torch.full_like(scores, float("-inf"))
            for b, c in enumerate(self.constraints):
                s = self.states[b]
                if not first and s not in (FINISHED, None):  # advance over last step's token
                    s = self.states[b] = c.step(s, int(input_ids[b, -1]))
                if s in (FINISHED, None):
                    out[b, eos] = 0.0  # finished rows pad with EOS
                else:
                    keep = c.mask(s)
                    out[b, : len(keep)][keep] = scores[b, : len(keep)][keep]
            return out

    jobs.sort(key=lambda j: len(j[0]))  # similar lengths share a batch: little padding
    out, t0, made = [], time.perf_counter(), 0
    for lo in range(0, len(jobs), args.batch):
        batch = jobs[lo : lo + args.batch]
        longest = max(len(p) for p, _ in batch)
        pad = eos
        x = torch.tensor([[pad] * (longest - len(p)) + p for p, _ in batch])
        attention = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in batch])
        result = target.generate(
            input_ids=x,
            attention_mask=attention,
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=pad,
            logits_processor=[Masked([c for _, c in batch])],
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        steps = [hs[-1] for hs in result.hidden_states]  # step 0: the prompt; then one per token
        for b, (prompt, _) in enumerate(batch):
            answer = result.sequences[b, longest:].tolist()
            if pad in answer:
                answer = answer[: answer.index(pad) + 1]
            h = torch.cat(
                [steps[0][b, longest - len(prompt) :]] + [s[b] for s in steps[1 : len(answer)]]
            )
            ids = prompt + answer[:-1]  # the last token was never fed: no feature
            assert len(h) == len(ids)
            out.append((ids, len(prompt), h.half()))
            made += len(answer)
        for _, constraint in batch:  # done with: free its per-state masks
            constraint.clear_caches()
        say(
            f"  {len(out)}/{len(jobs)} answered, {made} answer tokens, "
            f"{made / (time.perf_counter() - t0):.0f} tok/s"
        )
    return out


def dataset_answers(target, tokenizer, files, args, say):
    """--dataset-tokens of teacher-forced dataset answers, cached (and extended) next to --features."""
    cache = args.features and args.features.with_name(args.features.stem + ".dataset.pt")
    data = torch.load(cache)[0] if cache and cache.is_file() else []
    if sum(len(ids) for ids, _, _ in data) < args.dataset_tokens:
        data += collect(target, tokenizer, files, args, args.dataset_tokens, say, skip=len(data))
        if cache:
            torch.save((data, []), cache)
    say(f"dataset answers: {len(data)} sequences")
    return data


# --- 3. training ---------------------------------------------------------------------------------


def head_weight(target) -> torch.Tensor:
    """The target's LM head (V, d) in float32, every row (a compact model's dequantized)."""
    return kv.head_rows(target, torch.arange(logits_width(target)))


def sub_vocabulary(target, data, size: int) -> torch.Tensor:
    """The tokens the target most often puts first at answer positions (plus EOS)."""
    W = head_weight(target)
    counts = torch.zeros(W.shape[0])
    with torch.inference_mode():
        for ids, start, h in data:
            top = (h[start - 1 :].float() @ W.T).argmax(-1)
            counts += torch.bincount(top, minlength=len(counts)).float()
            counts[torch.tensor(ids[start:])] += 1
    return counts.argsort(descending=True)[:size].sort().values


def head_inputs(embed, ids, h, start):
    """Pairs (f_i, embeddings of x_{i+1} and its copy proposals) for i < n-1, the proposals
    (for x_{i+2}, the token pair i predicts), targets f_{i+1}; the loss covers pairs whose
    prediction is for an answer token: i + 2 >= start."""
    f, proposals = h.float(), copy_proposals(ids)[1:]
    return f[:-1], pair_embeddings(embed, ids[1:], proposals), proposals, f[1:], max(start - 2, 0)


def train(head, target, data, args, say):
    embed = target.get_input_embeddings()
    W = head_weight(target)
    std = torch.cat([h.float() for _, _, h in data[:50]]).std().item()
    params = [
        p
        for n, p in head.named_parameters()
        if "embed_tokens" not in n and ("copy_gate" in n or not args.gate_only)
    ]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    deadline = time.perf_counter() + 60 * args.minutes
    rng, step, order = random.Random(args.seed), 0, []
    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        if not order:
            order = list(range(len(data)))
            rng.shuffle(order)
        ids, start, h = data[order.pop()]
        f_in, e, proposals, f_next, first = head_inputs(embed, ids, h, start)
        first = first if args.loss_on == "answer" else 0
        f_next = f_next[first:-1]  # the last pair would predict past EOS
        vocab = (
            draft_vocabulary(head.draft_ids, ids[:start]) if args.prompt_vocab else head.draft_ids
        )
        rows = W[vocab].float()  # (N, d)
        copies = vocabulary_positions(vocab, proposals)
        # pair i predicts token i + 2: an answer token from i = start - 2 on
        weight = torch.ones(len(f_next))
        weight[max(start - 2 - first, 0) :] = args.answer_weight
        with torch.no_grad():
            f_in = f_in + args.noise * std * torch.randn_like(f_in)
            p = F.softmax(f_next @ rows.T, dim=-1)
        reg = cls = 0.0
        with torch.set_grad_enabled(not args.gate_only):
            preds = unrolled(head, f_in, e, args.train_steps)
        for s, pred in enumerate(preds):
            lo = max(first, s)  # step s needs s true-prefix positions before it
            w = weight[lo - first :] / weight[lo - first :].sum() / args.train_steps
            reg = (
                reg
                + (
                    w
                    * F.smooth_l1_loss(pred[lo:-1], f_next[lo - first :], reduction="none").mean(-1)
                ).sum()
            )
            logq = head.log_probs(pred[lo:-1], rows, copies[lo:-1])
            cls = cls - (w * (p[lo - first :] * logq).sum(-1)).sum()
        loss = (0 if args.gate_only else args.reg_weight * reg) + args.cls_weight * cls
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        elapsed = time.perf_counter() - t0
        frac = min(elapsed / (60 * args.minutes), 1.0)
        for g in opt.param_groups:  # warm-up then cosine, over the time budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        opt.step()
        step += 1
        if step % 100 == 0:
            say(
                f"  step {step} ({elapsed / 60:.1f} min): reg {reg.item():.3f} cls {cls.item():.3f}"
            )
    return step


# --- 4. evaluation -------------------------------------------------------------------------------


@torch.inference_mode()
def agreement(head, target, data, steps: int = 3, per_seq: int = 24, seed: int = 0):
    """Share of answer positions where the head's top sub-vocabulary token is the target's top
    token, at draft step 1 (true features) and steps 2..n (reading its own predicted features,
    fed the target's tokens) — unmasked, so a lower bound for masked agreement — and the share
    of target top tokens inside the sub-vocabulary (an upper bound)."""
    embed = target.get_input_embeddings()
    W = head_weight(target)
    hits, seen, covered, total = [0] * steps, [0] * steps, 0, 0
    rng = random.Random(seed)
    for ids, start, h in data:
        vocab = draft_vocabulary(head.draft_ids, ids[:start])  # as drafting: + the prompt's tokens
        rows = W[vocab].float()
        f = h.float()
        top = (f @ W.T).argmax(-1)  # top[i]: the target's choice for token i+1
        covered += int(torch.isin(top[start - 1 : -1], vocab).sum())
        total += len(ids) - start
        proposals = copy_proposals(ids)[1:]
        e, copies = (
            pair_embeddings(embed, ids[1:], proposals),
            vocabulary_positions(vocab, proposals),
        )
        for i in rng.sample(
            range(max(start - 2, 0), len(ids) - 1 - steps),
            k=min(per_seq, max(len(ids) - 1 - steps - max(start - 2, 0), 0)),
        ):
            cache = HeadCache()
            out = head(f[None, : i + 1], e[None, : i + 1], cache)[0, -1]  # predicts f_{i+1}
            for s in range(steps):
                choice = int(
                    vocab[head.log_probs(out[None], rows, copies[i + s : i + s + 1]).argmax()]
                )
                seen[s] += 1
                hits[s] += choice == int(top[i + 1 + s])
                if i + 2 + s >= len(ids):
                    break
                out = head(out[None, None], e[None, i + 1 + s : i + 2 + s], cache)[0, -1]
    return {
        "top1_by_step": [round(h / max(n, 1), 4) for h, n in zip(hits, seen)],
        "positions_by_step": seen,
        "sub_vocab_coverage": round(covered / max(total, 1), 4),
    }


@torch.inference_mode()
def step_costs(head, target, context_len: int = 400, reps: int = 20) -> dict:
    """ms of one target decode step and of one head draft step (one pair + sub-vocab logits),
    each after ``context_len`` cached positions."""
    ids = list(range(100, 100 + context_len))
    cache, head_cache = kv.new_cache(target), HeadCache()
    _, f = kv.forward(target, cache, ids, "cpu", features=True)
    proposals = copy_proposals(ids + [7])[1:]
    e = pair_embeddings(target.get_input_embeddings(), ids[1:] + [7], proposals)
    head(f[None], e[None], head_cache)
    rows = kv.head_rows(target, head.draft_ids)
    copies = vocabulary_positions(head.draft_ids, proposals[-1:])

    def target_step():
        kv.forward(target, cache, [5], "cpu")
        kv.crop(cache, context_len)

    def head_step():
        head.log_probs(head(f[None, -1:], e[None, -1:], head_cache)[0, -1:], rows, copies)
        head_cache.crop(context_len)

    def timed(fn):
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t) / reps

    target_ms, head_ms = timed(target_step), timed(head_step)
    return {
        "target_step_ms": round(target_ms, 2),
        "head_step_ms": round(head_ms, 2),
        "cost_ratio": round(head_ms / target_ms, 4),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if (args.out is None) == (args.evaluate is None):
        raise SystemExit("give --out (train a head) or --evaluate HEAD (measure one).")
    say = lambda *a: print(*a, flush=True)
    torch.manual_seed(args.seed)
    target, tokenizer = load_model(args.model)
    target.eval().requires_grad_(False)
    train_files, val_files = dataset_files(args)
    say(f"files: {len(train_files)} train, {len(val_files)} validation ({args.reserve} reserved)")
    train_data, val_data = [], []
    if args.features is not None and args.features.is_file():  # reused, extended if too short
        train_data, val_data = torch.load(args.features)
        say(f"features from {args.features}: {len(train_data)} + {len(val_data)} sequences")
    t, before = time.perf_counter(), (len(train_data), len(val_data))
    if args.answers == "target":
        if not train_data:
            train_data = self_distilled(
                target, tokenizer, train_files, args, args.train_tokens, say
            )
            val_data = self_distilled(target, tokenizer, val_files, args, args.val_tokens, say)
    else:
        train_data += collect(
            target, tokenizer, train_files, args, args.train_tokens, say, skip=len(train_data)
        )
        val_data += collect(
            target, tokenizer, val_files, args, args.val_tokens, say, skip=len(val_data)
        )
    if (len(train_data), len(val_data)) != before:
        say(
            f"collected {len(train_data)} + {len(val_data)} sequences in {time.perf_counter() - t:.0f} s"
        )
        if args.features is not None:
            torch.save((train_data, val_data), args.features)
    count = lambda data: (sum(len(i) for i, _, _ in data), sum(len(i) - s for i, s, _ in data))
    if args.evaluate:
        head = load_head(target, token_vocabulary(tokenizer), args.evaluate)
        say(
            json.dumps(
                {
                    "head": str(args.evaluate),
                    "val_tokens_and_answer_tokens": count(val_data),
                    "validation": agreement(head, target, val_data),
                    **step_costs(head, target),
                },
                indent=1,
            )
        )
        return 0
    card_data = {"train_tokens_and_answer_tokens": count(train_data)}
    if args.answers == "target" and args.dataset_tokens:  # training only: validation stays the
        extra = dataset_answers(target, tokenizer, train_files, args, say)  # target's own answers
        card_data["dataset_tokens_and_answer_tokens"] = count(extra)
        train_data = train_data + extra
    if args.init:  # a head from before the copy proposals starts with zero weights on them
        head = load_head(target, token_vocabulary(tokenizer), args.init).train()
    else:
        head = DraftHead.for_target(target, sub_vocabulary(target, train_data, args.sub_vocab))
        last = target.get_decoder().layers[-1]
        head.decoder.layers[0].load_state_dict(last.state_dict())  # warm start: the last layer
        head.decoder.norm.load_state_dict(target.get_decoder().norm.state_dict())
    if args.copy_gate and not torch.isfinite(head.copy_gate.bias).all():
        with torch.no_grad():  # open it: rarely trusted at first, the head drafts as before
            head.copy_gate.bias.fill_(-4.0)
    before = agreement(head.eval(), target, val_data)
    say(f"validation before training: {before}")
    t = time.perf_counter()
    steps = train(head.train(), target, train_data, args, say)
    train_s = time.perf_counter() - t
    head.eval()
    metrics = {
        "validation": agreement(head, target, val_data),
        "validation_before_training": before,
        **step_costs(head, target),
    }
    say(json.dumps(metrics, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    card = {
        "command": "python tools/train_head.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "vocab_fingerprint": token_vocabulary(tokenizer).fingerprint,
        "seed": args.seed,
        "train_sequences": len(train_data),
        "val_sequences": len(val_data),
        **card_data,
        "val_tokens_and_answer_tokens": count(val_data),
        "steps": steps,
        "train_minutes": round(train_s / 60, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "metrics": metrics,
    }
    head.save(args.out, card)
    say(
        f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) and {args.out.with_suffix('.json')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
