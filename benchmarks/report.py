"""report.md, summary.json and PNG plots from a benchmark's results.json.

Speedup of a configuration on a request = its tok/s ÷ the baseline's tok/s on the same request
(the baseline at the same temperature). Its aggregate = Σ tokens / Σ seconds over the requests
both finished, ÷ the same for the baseline. Output tokens exclude EOS; seconds are wall-clock
from chat messages in to token ids out.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

PHASES = ("setup", "prefill", "draft", "verify", "other")
# The speed goals the project set (greedy and sampled, over the masked baseline): the report says
# how far the best configuration is from them and what closing the gap would take.
GOALS = {"greedy": 3.0, "sampled": 2.0}


def run_metadata(script: str, argv: list[str], start: float) -> dict:
    """What a server benchmark's results.json says of its run (serve.py load, serve.py soak): the command,
    when and how long, the machine, the commit (dirty: tracked files changed) and the load
    average at its end."""

    def sh(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()

    return {
        "command": shlex.join(["python", script, *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start)),
        "minutes": (time.time() - start) / 60,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "commit": sh("git", "rev-parse", "--short=10", "HEAD")
        + (" (dirty)" if sh("git", "status", "--porcelain", "--untracked-files=no") else ""),
        "load_end": f"{os.getloadavg()[0]:.2f}",
    }


def baseline_for(temperature: float) -> str:
    return "baseline" if temperature == 0 else f"baseline@t{temperature:g}"


def rate(row: dict) -> float | None:
    return row["output_tokens"] / row["wall_s"] if row.get("output_tokens") else None


def _sum(rows, key) -> float:
    return sum(r.get(key) or 0 for r in rows)


def _add(acc: list, values: list) -> None:
    acc.extend([0] * (len(values) - len(acc)))
    for i, v in enumerate(values):
        acc[i] += v


def solve_alpha(tokens_per_call: float, k: int) -> float:
    """α with 1 + α + … + α^k = tokens per target call (i.i.d. acceptance, Leviathan et al.)"""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < tokens_per_call else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    alpha = min(alpha, 0.999999)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def summarize(results: dict) -> dict:
    configs = results["meta"]["configs"]
    by_config = defaultdict(list)
    for row in results["results"]:
        by_config[row["config"]].append(row)
    ok_rows = {
        name: {r["request"]: r for r in rows if r["status"] == "ok"}
        for name, rows in by_config.items()
    }
    out = {}
    for config in configs:
        name, rows = config["name"], by_config.get(config["name"], [])
        ok = list(ok_rows.get(name, {}).values())
        base = ok_rows.get(baseline_for(config["temperature"]), {})
        out[name] = _summary(config, rows, ok, base)
    base_step = out.get("baseline", {}).get("verify_ms_per_call")
    for s in out.values():  # cost ratio of a draft-model token to a baseline target step
        if s.get("draft_ms_per_model_token") and base_step:
            s["cost_ratio"] = s["draft_ms_per_model_token"] / base_step
    return out


def _paired_ratio(pairs: list, seconds: str) -> float:
    """Σ tokens / Σ seconds of the configuration ÷ the same of the baseline, on paired runs."""
    mine, theirs = [r for r, _ in pairs], [b for _, b in pairs]
    return (_sum(mine, "output_tokens") / _sum(mine, seconds)) / (
        _sum(theirs, "output_tokens") / _sum(theirs, seconds)
    )


def _summary(config: dict, rows: list, ok: list, base: dict) -> dict:
    s = {
        "config": config["name"],
        "kind": config["kind"],
        "temperature": config["temperature"],
        "runs": len(rows),
        "ok": len(ok),
        "errors": len(rows) - len(ok),
        "error_examples": sorted(
            {r.get("error", r["status"])[:160] for r in rows if r["status"] != "ok"}
        )[:3],
    }
    if not ok:
        return s
    tokens, wall = _sum(ok, "output_tokens"), _sum(ok, "wall_s")
    s["tok_s"] = tokens / wall if wall else None
    pairs = [
        (r, base[r["request"]])
        for r in ok
        if r["request"] in base and rate(r) and rate(base[r["request"]])
    ]
    speedups = [rate(r) / rate(b) for r, b in pairs]
    if pairs:
        s.update(
            speedup=_paired_ratio(pairs, "wall_s"),
            speedup_min=min(speedups),
            speedup_median=statistics.median(speedups),
            speedup_max=max(speedups),
            slower_share=sum(x < 1 for x in speedups) / len(speedups),
            speedups={r["request"]: x for (r, _), x in zip(pairs, speedups)},
        )
    gen_pairs = [(r, b) for r, b in pairs if r.get("gen_s") and b.get("gen_s")]
    if gen_pairs:  # the same without setup and prefill (which speculation cannot shorten)
        s["decode_speedup"] = _paired_ratio(gen_pairs, "gen_s")
    committed, calls = _sum(ok, "committed_tokens"), _sum(ok, "target_calls")
    s["tokens_per_call"] = committed / calls if calls else None
    s["verify_ms_per_call"] = (
        1e3 * _sum(ok, "verify_s") / calls if calls and config["kind"] == "engine" else None
    )
    s["valid"], s["valid_share"] = (
        sum(bool(r.get("valid")) for r in ok),
        sum(bool(r.get("valid")) for r in ok) / len(ok),
    )
    if any("exact_match" in r for r in ok):
        s["exact_match_share"] = sum(bool(r.get("exact_match")) for r in ok) / len(ok)
    if _sum(ok, "leaves"):
        s["leaf_accuracy"] = _sum(ok, "leaves_right") / _sum(ok, "leaves")
    s["stopped_share"] = sum(r["finish_reason"] != "length" for r in ok) / len(ok)
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    s["ttft_ms_mean"] = 1e3 * statistics.mean(ttfts) if ttfts else None
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    s["tpot_ms_median"] = 1e3 * statistics.median(tpots) if tpots else None
    s["latency_s_mean"] = wall / len(ok)
    s["rss_peak_mb"] = max((r.get("rss_peak_mb") or 0) for r in ok)
    s["output_tokens_mean"] = tokens / len(ok)
    if config["temperature"] == 0:
        s["identical"] = sum(r.get("identical") is True for r in ok)
        s["near_tie"] = sum(bool(r.get("near_tie")) for r in ok)
        s["diverged"] = sum(r.get("identical") is False and not r.get("near_tie") for r in ok)
        s["divergences"] = [
            {
                "request": r["request"],
                "index": r.get("first_divergence"),
                "gap": r.get("divergence_gap"),
            }
            for r in ok
            if r.get("identical") is False
        ]
    if config["kind"] == "engine":
        s.update(_engine_summary(ok, tokens))
    else:
        s["phases_ms_per_token"] = (
            {
                "prefill": 1e3 * _sum(ok, "ttft_s") / tokens,
                "other": 1e3 * (wall - _sum(ok, "ttft_s")) / tokens,
            }
            if tokens
            else None
        )
        s["mask_share"] = _sum(ok, "mask_s") / wall if wall else None
    return s


def _engine_summary(ok: list, tokens: int) -> dict:
    s: dict = {}
    drafted, accepted = _sum(ok, "drafted"), _sum(ok, "accepted")
    s["drafted"], s["accepted"] = drafted, accepted
    s["acceptance"] = accepted / drafted if drafted else None
    by_source = defaultdict(lambda: [0, 0])
    for r in ok:
        for src, n in (r.get("drafted_by_source") or {}).items():
            by_source[src][0] += n
        for src, n in (r.get("accepted_by_source") or {}).items():
            by_source[src][1] += n
    s["by_source"] = {
        src: {"drafted": d, "accepted": a, "rate": a / d if d else None}
        for src, (d, a) in sorted(by_source.items())
    }
    acc_pos, drafted_pos = [], []
    for r in ok:
        _add(acc_pos, r.get("accepted_by_position") or [])
        _add(drafted_pos, r.get("drafted_by_position") or [])
    s["accepted_by_position"], s["drafted_by_position"] = acc_pos, drafted_pos
    model_drafted = by_source.get("model", [0, 0])[0]
    s["draft_ms_per_model_token"] = (
        1e3 * _sum(ok, "draft_s") / model_drafted if model_drafted else None
    )
    if tokens:
        wall, decode = _sum(ok, "wall_s"), _sum(ok, "decode_s")
        parts = {
            "setup": wall - decode,
            "prefill": _sum(ok, "prefill_s"),
            "draft": _sum(ok, "draft_s"),
            "verify": _sum(ok, "verify_s"),
        }
        parts["other"] = decode - parts["prefill"] - parts["draft"] - parts["verify"]
        s["phases_ms_per_token"] = {k: 1e3 * v / tokens for k, v in parts.items()}
        s["mask_share"] = _sum(ok, "mask_s") / wall if wall else None
        loop = decode - parts["prefill"]  # the decode loop after the prompt: rounds only
        s["mask_share_of_loop"] = _sum(ok, "mask_s") / loop if loop > 0 else None
    per_token = [1e6 * r["mask_s"] / r["committed_tokens"] for r in ok if r.get("committed_tokens")]
    s["mask_us_per_token_p50"] = statistics.median(per_token) if per_token else None
    return s


def goal_gaps(summary: dict) -> list[dict]:
    """For the best engine configuration per temperature: the speedup against GOALS and the
    decode-loop arithmetic behind it. Per output token, time = prefix (setup + prefill, which
    speculation cannot shorten) + decode. The goal G needs decode ≤ baseline total / G − prefix,
    i.e. a decode speedup X = baseline decode / that; at today's cost per round that means
    tokens per target call × X / (measured decode speedup)."""
    gaps = []
    for label, goal in GOALS.items():
        best = best_speculative(summary, label == "greedy")
        base = summary.get(baseline_for(best["temperature"])) if best else None
        if not (
            best and best.get("phases_ms_per_token") and base and base.get("phases_ms_per_token")
        ):
            continue
        prefix = lambda s: s["phases_ms_per_token"]["setup"] + s["phases_ms_per_token"]["prefill"]
        decode = lambda s: sum(s["phases_ms_per_token"].values()) - prefix(s)
        room = sum(base["phases_ms_per_token"].values()) / goal - prefix(best)
        measured = decode(base) / decode(best)
        needed = decode(base) / room if room > 0 else None
        gaps.append(
            {
                "label": label,
                "config": best["config"],
                "goal": goal,
                "speedup": best["speedup"],
                "prefix_ms": prefix(best),
                "decode_ms": decode(best),
                "baseline_decode_ms": decode(base),
                "decode_speedup": measured,
                "decode_speedup_needed": needed,
                "tokens_per_call": best.get("tokens_per_call"),
                "acceptance": best.get("acceptance"),
                "verify_steps": best["verify_ms_per_call"] / base["verify_ms_per_call"]
                if best.get("verify_ms_per_call") and base.get("verify_ms_per_call")
                else None,
                "tokens_per_call_needed": best["tokens_per_call"] * needed / measured
                if needed and best.get("tokens_per_call")
                else None,
            }
        )
    return gaps


def verify_cost(calibration: dict | None, k: int) -> float | None:
    """A verify over k drafts (k + 1 tokens) ÷ a one-token step, from the calibration."""
    if not calibration:
        return None
    ms = {int(n): v for n, v in calibration["target_ms"].items()}
    n = min(ms, key=lambda m: (abs(m - (k + 1)), m))
    return ms[n] / ms[1]


def predictions(summary: dict, configs: list, calibration: dict | None = None) -> list[dict]:
    """Measured speedup vs k of the draft-model configurations (greedy, fixed k), and the
    prediction (1 − α^(k+1)) / ((1 − α)(k·c + 1)) from their α (solved from tokens per call)
    and c (draft time per model token in the loop ÷ baseline time per target step); with a
    calibration also c from bare forwards and a prediction that charges a verify's real cost."""
    table = []
    c_cal = (calibration or {}).get("cost_ratio")
    for config in configs:
        s = summary.get(config["name"], {})
        if (
            config["kind"] != "engine"
            or config["drafter"] is None
            or config["adaptive"]
            or config["temperature"] != 0
            or config["drafter"] in ("forced", "lookup")
            or config.get("min_confidence")
        ):  # an early stop: k is only a bound
            continue
        if s.get("tokens_per_call") is None or s.get("speedup") is None:
            continue
        k = config["k"]
        alpha = solve_alpha(s["tokens_per_call"], k)
        c = s.get("cost_ratio")
        v = verify_cost(calibration, k)
        if config["drafter"] not in ("int8", "head"):  # k bounds model tokens only: α from τ
            alpha = c_cal_row = v = None  # means nothing with free drafts mixed in
        else:
            c_cal_row = c_cal if config["drafter"] == "int8" else None  # the head: c (loop)
        table.append(
            {
                "config": config["name"],
                "drafter": config["drafter"],
                "k": k,
                "alpha": alpha,
                "cost_ratio": c,
                "tokens_per_call": s["tokens_per_call"],
                "predicted": predicted_speedup(alpha, k, c)
                if c is not None and alpha is not None
                else None,
                "cost_ratio_calibrated": c_cal_row,
                "predicted_calibrated": predicted_speedup(alpha, k, c_cal_row)
                if c_cal_row is not None
                else None,
                "verify_cost": v,
                "predicted_with_verify_cost": s["tokens_per_call"] / (k * c_draft + v)
                if (c_draft := c_cal_row if c_cal_row is not None else c) is not None
                and v is not None
                and alpha is not None
                else None,
                "measured": s["speedup"],
                "measured_decode": s.get("decode_speedup"),
            }
        )
    return table


# --- markdown ----------------------------------------------------------------------------------


def _f(x, fmt="{:.2f}", none="–") -> str:
    return none if x is None else fmt.format(x)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def best_speculative(summary: dict, greedy: bool) -> dict | None:
    """The engine configuration (not a baseline) with the largest speedup, greedy or sampled."""
    cands = [
        s
        for s in summary.values()
        if s["kind"] == "engine"
        and s.get("speedup")
        and not s["config"].startswith("baseline")
        and (s["temperature"] == 0) == greedy
    ]
    return max(cands, key=lambda s: s["speedup"]) if cands else None


def headline(summary: dict) -> list[str]:
    lines = []
    for label in ("greedy", "sampled"):
        best = best_speculative(summary, label == "greedy")
        if best is None:
            continue
        ident = ""
        if label == "greedy":
            ident = (
                f"; outputs identical to the baseline on {best['identical']}/{best['ok']} "
                f"requests ({best['near_tie']} near-tie divergences, "
                f"{best['diverged']} other)"
            )
        lines.append(
            f"- **{label}**: best speculative configuration `{best['config']}` runs at "
            f"**{best['speedup']:.2f}×** the masked baseline's tok/s "
            f"(per request: median {best['speedup_median']:.2f}×, min "
            f"{best['speedup_min']:.2f}×, max {best['speedup_max']:.2f}×; slower on "
            f"{best['slower_share']:.0%} of requests){ident}; valid "
            f"{best['valid']}/{best['ok']}."
        )
    peers = [s for s in summary.values() if s["kind"] != "engine" and s.get("speedup")]
    if peers:
        best = max(peers, key=lambda s: s["speedup"])
        lines.append(
            f"- **best peer**: `{best['config']}` at {best['speedup']:.2f}× the masked "
            f"baseline ({_f(best.get('tok_s'), '{:.1f}')} tok/s)."
        )
    return lines


def markdown(results: dict, summary: dict, preds: list[dict], plots: list[str]) -> str:
    meta, machine = results["meta"], results["meta"]["machine"]
    args = meta["args"]
    started = datetime.fromtimestamp(meta["started"], timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    minutes = (meta.get("finished", meta["started"]) - meta["started"]) / 60
    n = len(results["requests"])
    md = [
        f"# Benchmark: {args['workload']} workload, {meta['model']}",
        "",
        *(
            ["**Partial run** (stopped early): the requests finished so far.", ""]
            if meta.get("partial")
            else []
        ),
        f"Command: `{meta['command']}`",
        "",
        *(
            [f"Target weights (engine configurations but `baseline-float`): {meta['weights']}", ""]
            if meta.get("weights")
            else []
        ),
        f"Run {started}, {minutes:.0f} min; {n} requests × {len(meta['configs'])} "
        "configurations "
        f"(interleaved per request, order rotated), max_new_tokens={args['max_new_tokens']}, "
        f"seed {args['seed']}. Machine: {machine.get('cpu', '?')}, {machine.get('cpus')} CPUs, "
        f"torch {machine.get('torch')} ({machine.get('torch_threads')} threads), transformers "
        f"{machine.get('transformers')}, outlines {machine.get('outlines')}, outlines-core "
        f"{machine.get('outlines_core')}"
        + (
            f", llama-cpp-python {machine['llama_cpp_python']}"
            if machine.get("llama_cpp_python")
            else ""
        )
        + (
            f"; instruction sets: CPU {', '.join(machine['cpu_flags'])}, ours and torch's "
            f"--isa {machine['isa']} (torch {machine.get('torch_capability')})"
            if machine.get("cpu_flags") is not None and machine.get("isa")
            else ""
        )
        + (
            f"; llama.cpp built for: {machine['llama_cpp_system']}"
            if machine.get("llama_cpp_system")
            else ""
        )
        + "; load average at start "
        f"{_f((machine.get('loadavg_start') or [None])[0])}, at end "
        f"{_f((machine.get('loadavg_end') or [None])[0])}; git "
        f"{(machine.get('git_commit') or '?')[:10]}"
        f"{' (dirty)' if machine.get('git_dirty') else ''}.",
        "",
        f"Requests: {n} schemas from JSONSchemaBench-dev (seeded selection, list in "
        f"`requests.json`); skipped while selecting: "
        + (
            ", ".join(
                f"{k} {v}" for k, v in sorted(results["skipped"].items(), key=lambda kv: -kv[1])
            )
            or "none"
        )
        + ".",
        "",
        "## Headline",
        "",
        *headline(summary),
        "",
    ]
    rows = []
    for s in summary.values():
        ident = "–"
        if s["temperature"] == 0 and s.get("ok") and s["kind"] != "engine":
            ident = f"same text {s['identical']}/{s['ok']}"
        elif s["temperature"] == 0 and s.get("ok"):
            ident = (
                f"{s['identical']}/{s['ok']}"
                + (f" ({s['near_tie']} near-tie)" if s["near_tie"] else "")
                + (f" **{s['diverged']} diverged**" if s["diverged"] else "")
            )
        rows.append(
            [
                f"`{s['config']}`",
                f"{s['ok']}/{s['runs']}",
                _f(s.get("tok_s"), "{:.1f}"),
                _f(s.get("speedup")) + ("×" if s.get("speedup") else ""),
                _f(s.get("decode_speedup")) + ("×" if s.get("decode_speedup") else ""),
                " / ".join(_f(s.get(k)) for k in ("speedup_min", "speedup_median", "speedup_max")),
                _f(s.get("slower_share"), "{:.0%}"),
                _f(s.get("tokens_per_call")),
                _f(s.get("acceptance"), "{:.0%}"),
                _f(s.get("valid_share"), "{:.0%}"),
                _f(s.get("exact_match_share"), "{:.0%}"),
                _f(s.get("leaf_accuracy"), "{:.0%}"),
                ident,
                _f(s.get("ttft_ms_mean"), "{:.0f}"),
                _f(s.get("tpot_ms_median"), "{:.1f}"),
                _f(s.get("rss_peak_mb"), "{:.0f}"),
            ]
        )
    md += [
        "## Configurations",
        "",
        *_table(
            [
                "config",
                "ok/runs",
                "tok/s",
                "speedup",
                "excl. prefill",
                "min / median / max",
                "slower",
                "tokens/call",
                "acceptance",
                "valid",
                "exact",
                "leaves",
                "greedy identity",
                "TTFT ms",
                "TPOT ms",
                "peak RSS MB",
            ],
            rows,
        ),
        "",
        "tok/s = Σ output tokens / Σ wall seconds; speedup ÷ the baseline at the same "
        "temperature on the same requests; excl. prefill = the same ratio without setup and the "
        "prompt's prefill (engine: decode loop minus prefill; peers: after their first "
        "processor call); min/median/max over requests; slower = share of "
        "requests slower than the baseline; tokens/call = committed tokens (EOS included) per "
        "target forward that produced tokens; exact = a valid output equals the instance stated "
        "in the prompt, numbers compared as numbers; leaves = the share of the instance's leaf "
        "values a valid output has right at their paths (extract only; benchmarks/quality.py "
        "scores the same way); greedy identity = same token ids as the baseline "
        "(a divergence at a position whose top-2 masked logits differ by < "
        f"{meta['near_tie']:g} is a near-tie); for peers: the same text as the baseline, "
        "informational (their regex is outlines', not ours; llama.cpp's is its own JSON "
        "Schema grammar, which allows whitespace, and it runs the GGUF's Q4_1 weights, not "
        "the fp32 copy the others run). TTFT of peers ≈ time to their logits processor's "
        "first call (llama.cpp: to its first token).",
        "",
    ]
    md += _source_section(summary) + _phase_section(summary) + _goal_section(goal_gaps(summary))
    md += _calibration_section(meta.get("calibration")) + _prediction_section(preds)
    md += _errors_section(summary)
    md += [
        "## Plots",
        "",
        *(f"![{p}]({p})" for p in plots),
        "",
        "## Method",
        "",
        "- One process, same requests for every configuration; each configuration warmed up "
        "once on an extra request; each request first gets one untimed greedy baseline pass "
        "(fills the mask cache for the states it visits; the reference for greedy identity).",
        "- Timed: chat messages in → token ids out. Compile is excluded (ours is cached; "
        "outlines' processor is built before the clock, with the same time bound).",
        '- Peers use outlines\' `build_regex_from_schema` with compact whitespace (`""`), '
        "the same model object and tokenizer; transformers samples with top_k=0, top_p=1.",
        "- T=0.7: seeded per request (the same seed for every configuration); outputs differ "
        "between configurations by design, so only validity is checked (exactness is covered "
        "by the statistical tests).",
        "",
    ]
    return "\n".join(md)


SOURCE_ORDER = ("forced", "grammar", "lookup", "model")


def _source_section(summary: dict) -> list[str]:
    rows, seen = [], {src for s in summary.values() for src in s.get("by_source") or {}}
    sources = [src for src in SOURCE_ORDER if src in seen] + sorted(seen - set(SOURCE_ORDER))
    for s in summary.values():
        if not s.get("by_source"):
            continue
        cells = [_source_cell(s["by_source"].get(src)) for src in sources]
        rows.append(
            [
                f"`{s['config']}`",
                *cells,
                _f(s.get("draft_ms_per_model_token"), "{:.1f}"),
                _f(s.get("cost_ratio")),
            ]
        )
    if not rows:
        return []
    return [
        "## Acceptance by draft source",
        "",
        *_table(["config", *sources, "draft ms / model token", "cost ratio c"], rows),
        "",
        "accepted/drafted tokens per source (forced: the only legal token; grammar: forced "
        "text spelled in tokens where several spellings are legal; lookup: copied from the "
        "prompt/output; model: the draft model; a drafted token after a rejection counts as "
        "drafted, not accepted); c = draft time per model token ÷ the baseline's time per "
        "target step.",
        "",
    ]


def _source_cell(v: dict | None) -> str:
    return "–" if v is None else f"{v['accepted']}/{v['drafted']} ({_f(v['rate'], '{:.0%}')})"


def _phase_section(summary: dict) -> list[str]:
    rows = []
    for s in summary.values():
        ph = s.get("phases_ms_per_token")
        if not ph:
            continue
        total = sum(ph.values())
        rows.append(
            [
                f"`{s['config']}`",
                *(_f(ph.get(p), "{:.1f}") for p in PHASES),
                _f(total, "{:.1f}"),
                _f(s.get("mask_us_per_token_p50"), "{:.0f}"),
                _f(s.get("mask_share"), "{:.1%}"),
                _f(s.get("mask_share_of_loop"), "{:.1%}"),
            ]
        )
    return [
        "## Where the time goes (ms per output token)",
        "",
        *_table(
            ["config", *PHASES, "total", "mask µs/token p50", "mask share", "of the rounds"], rows
        ),
        "",
        "setup = generate() outside the decode loop (chat template, tokenizing, schema → "
        "regex, compiled-constraint lookup); prefill = the prompt's forward; draft = drafter "
        "propose calls; verify = target forward + acceptance + commit + KV crop; other = the "
        "rest of the loop. Mask time is time in the constraint's per-state work (masks "
        "for the target and for the drafters, forced text; lookups and first-time builds; "
        "applying the mask is part of verify); its share is of the whole request, and "
        "'of the rounds' of the decode loop after the prompt's prefill. Peers: prefill ≈ time to first "
        "processor call, the rest unsplit; their mask share is time inside the outlines "
        "processor.",
        "",
    ]


def _goal_section(gaps: list[dict]) -> list[str]:
    if not gaps:
        return []
    rows = [
        [
            g["label"],
            f"`{g['config']}`",
            f"{g['goal']:g}×",
            f"{g['speedup']:.2f}×",
            _f(g["prefix_ms"], "{:.1f}"),
            f"{g['decode_ms']:.1f} of {g['baseline_decode_ms']:.1f}",
            f"{g['decode_speedup']:.2f}×",
            _f(g["decode_speedup_needed"], "{:.2f}×", "unreachable"),
            _f(g["verify_steps"]),
            _f(g["tokens_per_call"]),
            _f(g["tokens_per_call_needed"]),
        ]
        for g in gaps
    ]
    lines = [
        "## Against the goals",
        "",
        *_table(
            [
                "",
                "best config",
                "goal",
                "measured",
                "prefill ms/token",
                "decode ms/token (of baseline's)",
                "decode speedup",
                "decode speedup needed",
                "verify ÷ baseline step",
                "tokens/call",
                "tokens/call needed",
            ],
            rows,
        ),
        "",
        "Per output token, prefill (+ setup) is time speculation cannot shorten; the goal "
        "leaves the decode loop baseline total ÷ goal − prefill, hence the decode speedup "
        "needed. verify ÷ baseline step = the loop's ms per target call (forward over the "
        "draft + acceptance + KV crop) ÷ the baseline's ms per one-token step. tokens/call "
        "needed = tokens per target call that would give the needed decode speedup at "
        "today's cost per round.",
        "",
    ]
    for g in gaps:
        if g["speedup"] >= g["goal"]:
            lines.append(f"- {g['label']}: goal met ({g['speedup']:.2f}× ≥ {g['goal']:g}×).")
        elif g["decode_speedup_needed"] is None:
            lines.append(
                f"- {g['label']}: {g['goal']:g}× is out of reach on these requests: "
                f"prefill alone ({g['prefix_ms']:.1f} ms/token) exceeds the baseline's "
                "time ÷ the goal."
            )
        else:
            lines.append(
                f"- {g['label']}: short of {g['goal']:g}× by "
                f"{g['goal'] / g['speedup']:.2f}×. The decode loop runs "
                f"{g['decode_speedup']:.2f}× faster than the baseline's and would need "
                f"{g['decode_speedup_needed']:.2f}×: each target call commits "
                f"{_f(g['tokens_per_call'])} tokens ({_f(g['acceptance'], '{:.0%}')} of "
                f"drafted tokens accepted) but costs {_f(g['verify_steps'])} "
                f"one-token steps, so it would need about "
                f"{_f(g['tokens_per_call_needed'], '{:.1f}')} tokens per call at that cost."
            )
    return lines + [""]


def _calibration_section(calibration: dict | None) -> list[str]:
    if not calibration:
        return []
    ms = calibration["target_ms"]
    rows = [
        [str(int(n) - 1), str(n), _f(v, "{:.1f}"), _f(v / ms[min(ms, key=int)])]
        for n, v in sorted(ms.items(), key=lambda kv: int(kv[0]))
    ]
    lines = [
        "## Forward costs (bare forwards, before the run)",
        "",
        f"After a {calibration['context_tokens']}-token context, median of 10:",
        "",
        *_table(["k drafts", "tokens fed", "target ms", "÷ one-token step"], rows),
        "",
    ]
    if "step_over_limit" in calibration:
        low, high = calibration["step_over_limit_range"]
        lines += [
            f"ms per step against the bandwidth limit: a one-token step reads "
            f"{calibration['weight_bytes'] / 1e6:.0f} MB of weights; at the measured read "
            f"bandwidth ({calibration['read_gb_s']:.1f} GB/s, summing a 1 GiB tensor) that takes "
            f"{calibration['bandwidth_limit_ms']:.1f} ms; the step takes "
            f"{calibration['step_ms']:.1f} ms, **{calibration['step_over_limit']:.2f}× the limit** "
            f"(medians of 7 rounds of one sum and 10 steps each; per round {low:.2f}–{high:.2f}×).",
            "",
        ]
    elif "bandwidth_limit_ms" in calibration:  # reports of runs before the rounds
        one = ms[min(ms, key=int)]
        lines += [
            f"ms per step against the bandwidth limit: a one-token step reads "
            f"{calibration['weight_bytes'] / 1e6:.0f} MB of weights; at the measured read "
            f"bandwidth ({calibration['read_gb_s']:.1f} GB/s, summing a 1 GiB tensor, median of 7) that "
            f"takes {calibration['bandwidth_limit_ms']:.1f} ms; the step takes {one:.1f} ms "
            f"({one / calibration['bandwidth_limit_ms']:.1f}× the limit).",
            "",
        ]
    if "draft_step_ms" in calibration:
        lines += [
            f"int8 draft: {calibration['draft_step_ms']:.1f} ms per one-token step "
            f"(c = {calibration['cost_ratio']:.2f} of a target step); its prefill of the "
            f"prompt: {calibration['draft_prefill_ms']:.0f} ms per request.",
            "",
        ]
    return lines


def _prediction_section(preds: list[dict]) -> list[str]:
    if not preds:
        return []
    rows = [
        [
            f"`{p['config']}`",
            str(p["k"]),
            _f(p["tokens_per_call"]),
            _f(p["alpha"]),
            _f(p["cost_ratio"]),
            _f(p["predicted"]),
            _f(p.get("cost_ratio_calibrated")),
            _f(p.get("predicted_calibrated")),
            _f(p.get("verify_cost")),
            _f(p.get("predicted_with_verify_cost")),
            _f(p["measured"]),
            _f(p.get("measured_decode")),
        ]
        for p in preds
    ]
    return [
        "## Speedup vs k: measured vs predicted",
        "",
        *_table(
            [
                "config",
                "k",
                "tokens/call",
                "α",
                "c (loop)",
                "predicted",
                "c (bare)",
                "predicted (bare c)",
                "verify cost",
                "predicted (+verify cost)",
                "measured",
                "measured excl. prefill",
            ],
            rows,
        ),
        "",
        "predicted = (1 − α^(k+1)) / ((1 − α)(k·c + 1)), α solved from tokens per call "
        "(1 + α + … + α^k). c (loop) = draft time per model token inside the loop (includes"
        " "
        "the draft model's prompt prefill and Python overhead) ÷ the baseline's time per "
        "target step; c (bare) = one int8 step ÷ one target step from the calibration. The "
        "formula assumes a verify costs one step; '+verify cost' divides tokens per call by "
        "k·c + (verify of k+1 tokens ÷ one step) instead (c bare for int8, c loop for the "
        "head). Measured includes prompt prefill, which speculation cannot shorten; 'excl. "
        "prefill' leaves it out. +lookup rows: measured only (lookup and grammar drafts are "
        "not bounded by k, so the i.i.d. model does not apply).",
        "",
    ]


def _errors_section(summary: dict) -> list[str]:
    rows = [
        [
            f"`{s['config']}`",
            str(s["errors"]),
            "<br>".join(e.replace("|", "\\|") for e in s["error_examples"]),
        ]
        for s in summary.values()
        if s["errors"]
    ]
    if not rows:
        return []
    return [
        "## Crashes and errors (recorded as results)",
        "",
        *_table(["config", "runs", "examples"], rows),
        "",
    ]


# --- plots -------------------------------------------------------------------------------------


def plot(results: dict, summary: dict, preds: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["config"] for s in summary.values() if s.get("speedup") is not None]
    files = []

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    y = range(len(names))
    ax.barh(
        y,
        [summary[n]["speedup"] for n in names],
        color=["tab:gray" if summary[n]["kind"] != "engine" else "tab:blue" for n in names],
    )
    ax.plot(
        [summary[n]["speedup_median"] for n in names],
        y,
        "k|",
        markersize=12,
        label="median per request",
    )
    ax.axvline(1, color="red", lw=1)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the masked baseline (aggregate tok/s; gray = peers)")
    ax.legend(loc="lower right")
    files.append(_save(fig, out, "speedup_by_config.png"))

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    data = [list(summary[n].get("speedups", {}).values()) for n in names]
    ax.boxplot(data, orientation="horizontal", tick_labels=names, showfliers=True)
    for i, d in enumerate(data, 1):
        ax.plot(d, [i] * len(d), ".", alpha=0.4, color="tab:blue")
    ax.axvline(1, color="red", lw=1)
    ax.invert_yaxis()
    ax.set_xlabel("per-request speedup over the masked baseline")
    files.append(_save(fig, out, "speedup_distribution.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summary.values():
        dr = s.get("drafted_by_position") or []
        acc = (s.get("accepted_by_position") or []) + [0] * len(dr)
        xs = [i + 1 for i in range(len(dr)) if dr[i] >= 5]
        if xs and s["temperature"] == 0:
            ax.plot(xs, [acc[i - 1] / dr[i - 1] for i in xs], marker=".", label=s["config"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at this position (greedy)")
    ax.set_ylim(0, 1.02)
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    files.append(_save(fig, out, "acceptance_by_position.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for drafter, color in (
        ("int8", "tab:blue"),
        ("int8+lookup", "tab:orange"),
        ("head", "tab:green"),
        ("head+lookup", "tab:red"),
    ):
        pts = sorted((p for p in preds if p["drafter"] == drafter), key=lambda p: p["k"])
        if not pts:
            continue
        ax.plot(
            [p["k"] for p in pts],
            [p["measured"] for p in pts],
            "o-",
            color=color,
            label=f"{drafter}: measured",
        )
        if drafter == "int8" and all(
            p["cost_ratio"] is not None and p["alpha"] is not None for p in pts
        ):
            alpha = statistics.mean(p["alpha"] for p in pts)
            c = pts[0].get("cost_ratio_calibrated") or statistics.mean(p["cost_ratio"] for p in pts)
            ks = list(range(1, max(p["k"] for p in pts) + 1))
            ax.plot(
                ks,
                [predicted_speedup(alpha, k, c) for k in ks],
                "--",
                color=color,
                label=f"predicted, α={alpha:.2f}, c={c:.2f}",
            )
            calibration = results["meta"].get("calibration")
            if calibration:  # the same, charging a verify its measured cost
                tau = lambda k: sum(alpha**i for i in range(k + 1))  # noqa: E731
                ax.plot(
                    ks,
                    [tau(k) / (k * c + verify_cost(calibration, k)) for k in ks],
                    ":",
                    color=color,
                    label="predicted with measured verify cost",
                )
    ax.axhline(1, color="red", lw=1)
    ax.set_xlabel("k (draft-model tokens per round)")
    ax.set_ylabel("speedup over the masked baseline")
    if ax.lines:
        ax.legend(fontsize=8)
    files.append(_save(fig, out, "speedup_vs_k.png"))

    phased = [s for s in summary.values() if s.get("phases_ms_per_token")]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(phased) + 1.5))
    left = [0.0] * len(phased)
    for phase in PHASES:
        widths = [s["phases_ms_per_token"].get(phase, 0) for s in phased]
        ax.barh(range(len(phased)), widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(phased)), [s["config"] for s in phased])
    ax.invert_yaxis()
    ax.set_xlabel("ms per output token")
    ax.legend(fontsize=8, loc="lower right")
    files.append(_save(fig, out, "phase_breakdown.png"))
    return files


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def write(results: dict, out: Path) -> dict:
    out = Path(out)
    summary = summarize(results)
    preds = predictions(summary, results["meta"]["configs"], results["meta"].get("calibration"))
    plots = plot(results, summary, preds, out)
    (out / "summary.json").write_text(
        json.dumps(
            {"summary": summary, "predictions": preds, "goals": goal_gaps(summary)}, indent=1
        )
    )
    (out / "report.md").write_text(markdown(results, summary, preds, plots))
    return summary
