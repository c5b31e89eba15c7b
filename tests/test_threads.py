"""Outputs do not depend on the thread count: the fused layers split their attention tasks by it
(two or more a thread), and every token's values must still be computed in the same order, so
a reply is the same on a busy machine that runs fewer threads as on a quiet one."""

import itertools

import pytest
import torch

from constrained_spec import Generator, testing
from constrained_spec.model import kernels, machine, models

SHAPES = {  # a sliding window and soft-caps (gemma2), q/k norms (qwen3), plain GQA (llama)
    "llama": dict(layers=2, heads=4, kv_heads=2),
    "qwen3": dict(layers=2, heads=4, kv_heads=2, head_dim=128),
    "gemma2": dict(
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=128,
        window=8,
        metadata={"gemma2.attn_logit_softcapping": 1.0, "gemma2.final_logit_softcapping": 2.0},
    ),
}


@pytest.fixture
def threads():
    kept = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(kept)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_every_thread_count_computes_the_same_bits(arch, tmp_path, threads):
    """A prompt, a one-token step, a 5-token verify pass and a batch of two rows, at 1, 2 and 3
    threads: the logits and the caches' keys bit for bit the same."""
    if missing := kernels.fused_missing():
        pytest.skip(f"the fused layers cannot run here: {missing}")
    path = testing.write_gguf(tmp_path / f"{arch}.gguf", arch, "Q4_0", **SHAPES[arch])
    model = testing.compact_gguf(path)
    assert models.use_kernels(model).startswith("fused/")
    ids = torch.arange(3, 60, dtype=torch.long) % model.vocab_size
    seen = {}
    for count in (1, 2, 3):
        threads(count)
        cache, other = model.new_cache(), model.new_cache()
        prompt = model(ids[:40], cache)[0]
        step = model(ids[40:41], cache)[0]
        verify = model(ids[41:46], cache)[0]
        model(ids[:20], other)
        rows, _ = model.forward_rows([ids[46:49], ids[20:22]], [cache, other])
        seen[count] = [prompt, step, verify, rows, cache.positions_keys(cache.length)]
    for count in (2, 3):
        for name, a, b in zip(("prompt", "step", "verify", "rows", "keys"), seen[1], seen[count]):
            assert torch.equal(a, b), f"{arch}: the {name} differs at {count} threads"


@pytest.fixture
def follow(monkeypatch, threads):
    """machine.follow_free_cores from a fresh state, on a 2-core machine whose CPU times the
    test gives: (the machine's busy CPU seconds, this process's, wall seconds)."""
    monkeypatch.delenv(machine.FOLLOW_ENV, raising=False)
    monkeypatch.setattr(machine, "_follow", {"at": None, "ceiling": None, "set": None})
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    times = []
    monkeypatch.setattr(machine, "cpu_times", lambda: times.pop(0))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: times[0][2] if times else 1e9)
    return times


def test_threads_follow_the_cores_other_processes_leave_free(follow, threads):
    """A neighbour busy on one of two cores: one thread; gone: two again; never more than the
    count the user set."""
    threads(2)
    follow += [(0.0, 0.0, 0.0), (2.0, 1.0, 1.0), (3.0, 2.0, 2.0), (3.1, 2.1, 2.1)]
    assert machine.follow_free_cores() == 2  # the first call only starts the clock
    assert machine.follow_free_cores() == 1 == torch.get_num_threads()  # others: 1 core of 2
    assert machine.follow_free_cores() == 2 == torch.get_num_threads()  # others: none
    assert machine.follow_free_cores() == 2  # 0.1 s later: not judged
    threads(1)  # the user's count is the ceiling
    follow += [(10.0, 5.0, 10.0), (10.0, 10.0, 15.0)]
    assert machine.follow_free_cores() == 1
    assert machine.follow_free_cores() == 1


def test_the_setting_turns_it_off(follow, threads, monkeypatch):
    threads(2)
    monkeypatch.setenv(machine.FOLLOW_ENV, "0")
    follow += [(0.0, 0.0, 0.0), (2.0, 0.0, 1.0)]
    assert machine.follow_free_cores() == machine.follow_free_cores() == 2


def test_a_reply_is_the_same_when_the_thread_count_changes_between_passes(
    tmp_path, threads, monkeypatch
):
    """Greedy and sampled replies on a fused-layers model, speculative: the thread count switched
    between 1 and 2 before every pass gives the tokens a fixed count gives."""
    if missing := kernels.fused_missing():
        pytest.skip(f"the fused layers cannot run here: {missing}")
    monkeypatch.setenv(machine.CACHE_ENV, str(tmp_path / "cache"))
    path = testing.write_gguf(tmp_path / "llama.gguf", "llama", "Q4_0", **SHAPES["llama"])
    gen = Generator.from_pretrained(str(path), weights="int4")
    assert models.use_kernels(gen.target).startswith("fused/")
    requests = [dict(temperature=0.0), dict(temperature=1.0, seed=3)]
    counts, switched = itertools.cycle((1, 2)), []
    replies = {}
    for mode in ("fixed", "switching"):
        switch = (
            (lambda: switched.append(torch.set_num_threads(next(counts))))
            if mode == "switching"
            else int
        )
        monkeypatch.setattr(machine, "follow_free_cores", switch)
        threads(2)
        replies[mode] = [
            gen.generate("ab", regex="[a-z]{3,30}", max_new_tokens=30, **r).token_ids
            for r in requests
        ]
    assert len(switched) >= 10, f"{len(switched)} passes switched: the loop did not ask"
    assert replies["fixed"] == replies["switching"]
