"""Outputs do not depend on the thread count: the fused layers split their attention tasks by it
(two or more a thread), and every token's values must still be computed in the same order, so
a reply is the same on a busy machine that runs fewer threads as on a quiet one."""

import pytest
import torch

from constrained_spec import testing
from constrained_spec.model import kernels, models

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
