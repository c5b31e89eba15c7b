"""Generator.stream: committed text in pieces, then the Result; the same output as generate."""

import pytest

from constrained_spec import GenerationInputError, Generator, Result
from constrained_spec.testing import PERSON, assert_greedy_match

PROMPTS = ["hello", '{"name": "Alice", "age": 30}', "yes no yes"]


def split(items):
    """(the text pieces, the final Result), checking that only the last item is the Result."""
    *pieces, result = items
    assert isinstance(result, Result) and all(isinstance(p, str) and p for p in pieces)
    return pieces, result


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_stream_equals_generate_and_the_baseline(
    prompt, tiny_target, tiny_draft, tiny_tokenizer
):
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    base = gen.generate(prompt, schema=PERSON, speculative=False, max_new_tokens=80)
    rounds = []
    pieces, streamed = split(
        gen.stream(prompt, schema=PERSON, max_new_tokens=80, on_round=rounds.append)
    )
    assert sum(len(r.drafted) for r in rounds) > 0, "nothing was drafted: speculation unused"
    assert "".join(pieces) == streamed.text
    assert streamed.finish_reason == base.finish_reason and streamed.value == base.value
    constraint = gen.compile(schema=PERSON)
    ids = tiny_tokenizer.encode(prompt)
    assert_greedy_match(tiny_target, constraint, ids, base.token_ids, streamed.token_ids)
    assert streamed.token_ids == gen.generate(prompt, schema=PERSON, max_new_tokens=80).token_ids


def test_each_piece_is_the_text_of_committed_tokens(tiny_target, tiny_draft, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer, draft=tiny_draft)
    committed, pieces = [], []

    def on_round(r):
        committed.extend(r.committed)

    for item in gen.stream("hello", schema=PERSON, temperature=1.0, seed=3, on_round=on_round):
        if isinstance(item, str):
            pieces.append(item)
            # never ahead of what was committed: no draft that a later round could reject; only
            # a character split across tokens waits for its last bytes
            done, text = gen.vocab.output_bytes(committed), "".join(pieces).encode()
            assert done.startswith(text) and len(done) - len(text) < 4
    assert len(pieces) > 1


def test_a_character_split_across_tokens_comes_out_whole(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    pieces, result = split(gen.stream("hello", regex="東京!", max_new_tokens=12))
    assert result.finish_reason == "stop" and result.text == "東京!"
    assert not all(_is_utf8(gen.vocab.output_bytes([t])) for t in result.token_ids), (
        "every token holds whole characters: nothing was split"
    )
    assert "".join(pieces) == result.text and not any("\ufffd" in p for p in pieces)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_closing_the_stream_stops_decoding(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    calls = []
    hook = tiny_target.register_forward_hook(lambda *a: calls.append(1))
    try:
        stream = gen.stream("hello", regex="[a-z]{40}", max_new_tokens=41)
        assert calls == [], "stream() ran the model before it was iterated"
        assert isinstance(next(stream), str)
        stream.close()
        after_close = len(calls)
        assert after_close <= 3  # the prefill and a round or two, not 40 rounds
        with pytest.raises(StopIteration):
            next(stream)
        assert len(calls) == after_close
    finally:
        hook.remove()


def test_bad_input_fails_when_stream_is_called(tiny_target, tiny_tokenizer):
    gen = Generator(tiny_target, tiny_tokenizer)
    with pytest.raises(GenerationInputError, match="temperature"):
        gen.stream("hello", regex="yes", temperature=-1.0)  # not iterated: raised at the call


def test_an_open_stream_holds_the_generators_lock(tiny_target, tiny_tokenizer):
    import threading

    gen = Generator(tiny_target, tiny_tokenizer)
    stream = gen.stream("hello", regex="[a-z]{40}", max_new_tokens=41)
    next(stream)  # decoding has begun: the lock is held
    other = threading.Thread(target=gen.generate, args=("hello",), kwargs={"regex": "yes"})
    other.start()
    other.join(timeout=0.5)
    assert other.is_alive(), "another request ran while the stream was decoding"
    stream.close()  # releases the lock: the other request runs
    other.join(timeout=60)
    assert not other.is_alive()
