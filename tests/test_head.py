"""The trained-draft-head drafter on tiny models (random heads: the plumbing, not the quality):
greedy identity, feature bookkeeping and head-cache rollback, weight files and their errors.
Its sampling exactness is in test_exactness.py; the shipped head on the real model in
test_models.py."""

import copy
import json

import pytest
import torch

from constrained_spec import Generator
from constrained_spec.constraints.vocabulary import token_vocabulary
from constrained_spec.decoding.head import (
    COPY_NGRAMS,
    HeadCache,
    HeadDraft,
    copy_proposals,
    load_head,
    pair_embeddings,
    shipped_head,
    unrolled,
    vocabulary_positions,
)
from constrained_spec.errors import DraftHeadError, VocabularyMismatch
from constrained_spec.model import kv
from constrained_spec.testing import PERSON, assert_greedy_match, random_head


def pair_width(head):
    """Width of a pair's embeddings: the token's and its copy proposals'."""
    return head.fuse.in_features - head.fuse.out_features


@pytest.mark.parametrize("prompt", ["hello", '{"name": "Alice", "age": 30}'])
def test_greedy_with_a_head_equals_the_masked_baseline(prompt, tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer, draft=random_head(tiny_target))
    base = gen.generate(prompt, schema=PERSON, speculative=False, max_new_tokens=80)
    spec = gen.generate(prompt, schema=PERSON, num_draft_tokens=4, max_new_tokens=80)
    assert_greedy_match(
        tiny_target,
        gen.compile(schema=PERSON),
        tiny_tokenizer.encode(prompt),
        base.token_ids,
        spec.token_ids,
    )
    assert spec.stats.drafted_by_source.get("model", 0) > 0, "the head never drafted"


@torch.no_grad()
def test_head_forward_is_the_llama_layer(tiny_target):
    """The head calls its decoder layer's modules directly (for speed): the same numbers as
    transformers' LlamaModel forward over the fused inputs, in one pass or in cached chunks."""
    head = random_head(tiny_target, seed=2)
    width = tiny_target.config.hidden_size
    features, embeds = torch.randn(1, 9, width), torch.randn(1, 9, pair_width(head))
    reference = head.decoder(
        inputs_embeds=head.fuse(torch.cat([features, embeds], -1))
    ).last_hidden_state
    torch.testing.assert_close(head(features, embeds), reference, atol=1e-5, rtol=1e-5)
    cache = HeadCache()
    chunks = [head(features[:, a:b], embeds[:, a:b], cache) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(chunks, 1), reference, atol=1e-5, rtol=1e-5)
    cache.crop(4)  # roll back to 4 pairs and redo the rest
    torch.testing.assert_close(
        head(features[:, 4:], embeds[:, 4:], cache), reference[:, 4:], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_head_reads_the_true_features_and_its_cache_rolls_back(
    temperature, tiny_target, tiny_tokenizer
):
    """After every round: the head holds the target's features of every committed token but the
    last (equal to a fresh forward), and its cache + the pending pairs give the same output as a
    fresh pass of the head over all pairs, copy proposals computed afresh; some rounds rejected
    a head-drafted token."""
    gen = Generator(tiny_target, tiny_tokenizer, draft=random_head(tiny_target))
    drafter: HeadDraft = gen.drafter.model
    committed, rejected = tiny_tokenizer.encode("hello"), []

    @torch.no_grad()
    def check(rnd):
        committed.extend(rnd.committed)
        _, fresh = kv.forward(
            tiny_target, kv.new_cache(tiny_target), committed[:-1], "cpu", features=True
        )
        torch.testing.assert_close(drafter.features, fresh, atol=1e-4, rtol=1e-4)
        pairs = len(drafter.cache)
        assert pairs == drafter.true_pairs <= len(fresh)
        embeds = pair_embeddings(
            tiny_target.get_input_embeddings(), committed[1:], copy_proposals(committed)[1:]
        )
        cache = copy.deepcopy(drafter.cache)
        resumed = drafter.head(fresh[None, pairs:], embeds[None, pairs:], cache)[0, -1]
        full = drafter.head(fresh[None], embeds[None])[0, -1]
        torch.testing.assert_close(resumed, full, atol=1e-4, rtol=1e-4)
        model_tokens = [i for i, s in enumerate(rnd.sources) if s == "model"]
        rejected.append(any(i >= rnd.accepted for i in model_tokens))

    gen.generate(
        "hello", schema=PERSON, temperature=temperature, seed=3, max_new_tokens=60, on_round=check
    )
    assert any(rejected), "no head-drafted token was rejected: the rollback was not exercised"


def test_copy_proposals_are_the_token_after_the_latest_earlier_ngram():
    """Row j holds, per n in COPY_NGRAMS, the token after the latest earlier occurrence of the
    n tokens ending at j: against a brute-force search, incremental or all at once."""
    import random

    from constrained_spec.decoding.head import CopyProposals

    def brute(ids, n, j):
        for m in range(j - 1, n - 2, -1):
            if j >= n - 1 and ids[m - n + 1 : m + 1] == ids[j - n + 1 : j + 1]:
                return ids[m + 1]
        return -1

    rng = random.Random(0)
    assert copy_proposals([5, 1, 2, 3, 9, 1, 2, 7, 1, 2])[-1] == [7, 7]
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        expected = [[brute(ids, n, j) for n in COPY_NGRAMS] for j in range(len(ids))]
        assert copy_proposals(ids) == expected
        proposals, split = CopyProposals(), rng.randrange(len(ids) + 1)
        assert proposals.between(ids, 0, split, committed=True) == expected[:split]
        assert proposals.between(ids, split, len(ids)) == expected[split:]  # drafted tail


def test_the_copy_gate_mixes_the_proposals_into_q(tiny_target):
    """q = π₀ softmax(rows · out) + Σ πₙ one-hot(proposal n), π = softmax(0, gate(out)) over the
    proposals present: a distribution, by hand; a closed gate (a head trained without it) or no
    proposal leaves the head's own softmax."""
    head = random_head(tiny_target, seed=5)
    torch.manual_seed(5)
    out, rows = torch.randn(3, head.fuse.out_features), torch.randn(6, head.fuse.out_features)
    copies = torch.tensor([[2, 2], [4, -1], [-1, -1]])  # both on one token; one; none
    q = head.log_probs(out, rows, copies).exp()
    softmax, gate = torch.softmax(out @ rows.T, -1), head.copy_gate(out)
    pi = [torch.softmax(torch.stack([torch.tensor(0.0), *g]), 0) for g in (gate[0], gate[1][:1])]
    expected = torch.stack([pi[0][0] * softmax[0], pi[1][0] * softmax[1], softmax[2]])
    expected[0, 2] += pi[0][1] + pi[0][2]
    expected[1, 4] += pi[1][1]
    torch.testing.assert_close(q, expected)
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    assert pi[0][1] + pi[0][2] > 0.05 and pi[1][1] > 0.05, "the test gate is hardly open"
    with torch.no_grad():
        head.copy_gate.bias.fill_(float("-inf"))
    torch.testing.assert_close(
        head.log_probs(out, rows, copies), torch.log_softmax(out @ rows.T, -1)
    )
    # proposals as positions in the draft vocabulary: absent ones and outsiders are -1
    assert vocabulary_positions(torch.tensor([1, 3, 5, 8]), [[3, 4], [-1, 8]]).tolist() == [
        [1, -1],
        [-1, 3],
    ]


def saved_head(tmp_path, target, tokenizer):
    head = random_head(target, seed=1)
    path = tmp_path / "tiny.safetensors"
    head.save(path, {"vocab_fingerprint": token_vocabulary(tokenizer).fingerprint})
    return head, path


def test_saved_head_loads_back(tmp_path, tiny_target, tiny_tokenizer):
    head, path = saved_head(tmp_path, tiny_target, tiny_tokenizer)
    loaded = load_head(tiny_target, token_vocabulary(tiny_tokenizer), path)
    assert torch.equal(loaded.draft_ids, head.draft_ids)
    x, e = torch.randn(1, 5, tiny_target.config.hidden_size), torch.randn(1, 5, pair_width(head))
    torch.testing.assert_close(loaded(x, e), head(x, e), atol=2e-2, rtol=2e-2)  # fp16 on disk
    gen = Generator(tiny_target, tiny_tokenizer, draft=loaded)
    assert gen.generate("hello", regex="(ab|ba)+", max_new_tokens=6).text


def test_missing_corrupt_or_foreign_head_files_are_clear_errors(
    tmp_path, tiny_target, tiny_tokenizer
):
    vocab = token_vocabulary(tiny_tokenizer)
    with pytest.raises(DraftHeadError, match="not found"):
        load_head(tiny_target, vocab, tmp_path / "absent.safetensors")
    _, path = saved_head(tmp_path, tiny_target, tiny_tokenizer)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DraftHeadError, match="corrupt"):
        load_head(tiny_target, vocab, path)
    _, path = saved_head(tmp_path, tiny_target, tiny_tokenizer)
    card = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps({**card, "vocab_fingerprint": "other"}))
    with pytest.raises(VocabularyMismatch, match="another tokenizer"):
        load_head(tiny_target, vocab, path)
    with pytest.raises(DraftHeadError, match="no trained draft head ships for 'nope'"):
        shipped_head("nope")


def rewrite_fuse(path, columns):
    """The weight file with the fuse layer cut to ``columns`` input columns and no copy gate (a
    head from before either), card resealed."""
    import hashlib

    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors["fuse.weight"] = tensors["fuse.weight"][:, :columns].contiguous()
    tensors = {k: v for k, v in tensors.items() if not k.startswith("copy_gate")}
    save_file(tensors, path)
    card = json.loads(path.with_suffix(".json").read_text())
    card["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_suffix(".json").write_text(json.dumps(card))


def test_a_head_from_before_the_copy_proposals_loads_as_itself(
    tmp_path, tiny_target, tiny_tokenizer
):
    """Heads saved before the copy proposals (fuse over feature + token only, no copy gate) load
    with zero weights on the proposals and the gate closed, which reproduces them; any other
    shape is a clear error."""
    vocab, width = token_vocabulary(tiny_tokenizer), tiny_target.config.hidden_size
    head, path = saved_head(tmp_path, tiny_target, tiny_tokenizer)
    rewrite_fuse(path, 2 * width)
    old = load_head(tiny_target, vocab, path)
    assert torch.equal(
        old.fuse.weight[:, 2 * width :], torch.zeros(width, pair_width(head) - width)
    )
    x, e = torch.randn(1, 5, width), torch.randn(1, 5, pair_width(head))
    without_copies = torch.cat([e[..., :width], torch.zeros_like(e[..., width:])], -1)
    torch.testing.assert_close(old(x, e), old(x, without_copies))
    rows, copies = torch.randn(6, width), torch.tensor([[1, 2]] * 5)
    torch.testing.assert_close(
        old.log_probs(old(x, e)[0], rows, copies), torch.log_softmax(old(x, e)[0] @ rows.T, -1)
    )
    rewrite_fuse(path, width + 1)
    with pytest.raises(DraftHeadError, match="do not fit"):
        load_head(tiny_target, vocab, path)


def test_auto_picks_the_head_only_where_one_ships():
    from constrained_spec.decoding.head import has_shipped_head

    assert has_shipped_head("smollm2-135m-instruct")
    assert not has_shipped_head("some-other-model")
    assert not has_shipped_head("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: its own model
    assert not has_shipped_head(None)


def test_unknown_head_fails_before_loading_a_model(monkeypatch):
    import constrained_spec.generator as generator

    monkeypatch.setattr(generator, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(DraftHeadError, match="no trained draft head"):
        Generator.from_pretrained("some/other-model", draft="head")


@pytest.mark.real_model
def test_shipped_head_on_the_default_model():
    """The shipped head loads (file intact, same tokenizer), drafts, and greedy decoding with it
    gives the masked baseline's tokens."""
    gen = Generator.from_pretrained(draft="head")
    messages = [{"role": "user", "content": "Extract as JSON: Alice is 30 years old."}]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    base = gen.generate(messages, schema=schema, speculative=False, max_new_tokens=24)
    spec = gen.generate(messages, schema=schema, max_new_tokens=24)
    assert_greedy_match(
        gen.target,
        gen.compile(schema=schema),
        gen.encode_prompt(messages),
        base.token_ids,
        spec.token_ids,
    )
    assert spec.stats.drafted_by_source.get("model", 0) > 0
    assert spec.stats.target_calls < base.stats.target_calls


def test_training_unroll_is_what_drafting_computes(tiny_target):
    """head.unrolled (EAGLE-3's training-time test) at step s, position j must equal the
    drafting head after true pairs 0..j-s and s chained steps on its own outputs: the loss trains
    what the drafter runs."""
    head = random_head(tiny_target)
    torch.manual_seed(1)
    width = head.fuse.out_features
    f, e = torch.randn(10, width), torch.randn(10, pair_width(head))
    with torch.no_grad():
        steps = unrolled(head, f, e, 3)
        torch.testing.assert_close(steps[0], head(f[None], e[None])[0])
        for anchor in range(10 - 3):
            cache = HeadCache()
            out = head(f[None, : anchor + 1], e[None, : anchor + 1], cache)[0, -1]
            for s in (1, 2):
                out = head(out[None, None], e[None, anchor + s : anchor + s + 1], cache)[0, -1]
                torch.testing.assert_close(out, steps[s][anchor + s], atol=1e-5, rtol=1e-5)
