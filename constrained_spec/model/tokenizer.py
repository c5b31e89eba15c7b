"""A prepared model's tokenizer on the `tokenizers` library alone: what the package reads off a
transformers fast tokenizer (ids ↔ text, special and added tokens, the chat template), without
importing transformers (≈ 0.5 s) or building its tokenizer (≈ 0.6 s for SmolLM2's) on each start.

``Tokenizer.of(transformers_tokenizer)`` takes it once, when a model is prepared; the state it
keeps is plain values, stored in the prepared file (model.prepared). The chat template renders
as transformers renders it: the same Jinja sandbox and options, helpers and special-token
variables (a test compares both on the shipped templates, tools included).

A BPE backend is kept in a form that loads faster than its own JSON: ``tokenizers`` reads a
model's vocabulary and merges through a generic JSON value first (Gemma 3's 262k tokens and 515k
merges: 1.2 s), while the same model built from a dict and a list of pairs takes 0.55 s. So the
state keeps the JSON without them, the merges as pairs of ids into ``pieces`` (which hold the
vocabulary), and the load builds the model from those (``_bpe_backend``); taken only where the
result writes back the very JSON it came from (``_fast_form``), else the JSON whole.
"""

from __future__ import annotations

import base64
import functools
import json
from array import array
from datetime import datetime

import tokenizers


class Tokenizer:
    """Ids ↔ text through ``backend`` (a ``tokenizers.Tokenizer``); ``len()`` counts the added
    tokens, as transformers does."""

    def __init__(self, backend: tokenizers.Tokenizer, state: dict):
        self.backend_tokenizer = backend
        self._state = state
        self._pieces: list[str | None] | None = state.get("pieces")
        self.chat_template: str | None = state["chat_template"]
        self.eos_token: str = state["eos_token"]
        self.special_tokens: dict = state["special_tokens"]  # bos_token, eos_token, ...: text
        self.all_special_ids: list[int] = state["special_ids"]
        self.unused_token_ids = frozenset(state["unused_token_ids"])
        self.added_tokens_decoder = {
            int(i): tokenizers.AddedToken(content, special=special)
            for i, (content, special) in state["added"].items()
        }
        if "eos_token_id" in state:
            self.eos_token_id, self.pad_token_id = state["eos_token_id"], state["pad_token_id"]
        else:  # a state stored before they were
            self.eos_token_id = backend.token_to_id(self.eos_token)
            pad = self.special_tokens.get("pad_token")
            self.pad_token_id = backend.token_to_id(pad) if isinstance(pad, str) else None

    @classmethod
    def of(cls, tokenizer) -> Tokenizer:
        """The same tokenizer as ``tokenizer`` (a transformers fast tokenizer)."""
        if isinstance(tokenizer, cls):
            return tokenizer
        backend = tokenizer.backend_tokenizer.to_str()
        # each id's piece, read for the vocabulary's bytes at every load (one backend call per
        # id: 0.34 s for Gemma's 262k tokens)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        form, built = _fast_form(backend, pieces)
        state = {
            **form,  # "backend", and "bpe" where that form holds
            "pieces": pieces,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "size": len(tokenizer),
            "chat_template": tokenizer.chat_template,
            "eos_token": str(tokenizer.eos_token),
            "special_tokens": {
                k: v if isinstance(v, str) else [str(t) for t in v]
                for k, v in tokenizer.special_tokens_map.items()
            },
            "special_ids": sorted(tokenizer.all_special_ids),
            "unused_token_ids": sorted(getattr(tokenizer, "unused_token_ids", ())),
            "added": {
                str(i): (t.content, bool(t.special))
                for i, t in tokenizer.added_tokens_decoder.items()
            },
        }
        # the fast form's tokenizer was built to check it (0.3 s at a 150k vocabulary): kept
        return cls.from_state(state) if built is None else cls(built, state)

    @classmethod
    def from_state(cls, state: dict) -> Tokenizer:
        if "bpe" in state:  # _fast_form's
            return cls(_bpe_backend(state["backend"], state["bpe"], state["pieces"]), state)
        return cls(tokenizers.Tokenizer.from_str(state["backend"]), state)

    def state(self) -> dict:
        """Plain values (strings, numbers, lists, dicts) from which ``from_state`` rebuilds it."""
        return self._state

    def __len__(self) -> int:
        return self._state["size"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._piece(ids)
        ids, pieces = list(ids), self._pieces
        if pieces is not None and ids and 0 <= min(ids) and max(ids) < len(pieces):
            return list(map(pieces.__getitem__, ids))  # C-level (Gemma 3's 262k: 10 ms, was 40)
        return [self._piece(i) for i in ids]

    def _piece(self, i: int) -> str | None:
        pieces = self._pieces
        return (
            pieces[i] if pieces and 0 <= i < len(pieces) else self.backend_tokenizer.id_to_token(i)
        )

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **variables,
    ):
        """The chat as the model was tuned to read it (text, or its ids where ``tokenize``)."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template: pass a plain prompt string or token ids."
            )
        text = _compiled(self.chat_template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **variables,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _fast_form(backend: str, pieces: list[str | None]):
    """The state's backend: {"backend": the JSON with the BPE's vocabulary and merges left out,
    "bpe": its vocabulary's size (``pieces``' first ids) and merges (``_merges``)} where
    ``_bpe_backend`` gives back exactly ``backend``'s tokenizer (its JSON, written again, is
    ``backend``), with that tokenizer; else ({"backend": backend}, None)."""
    parts = json.loads(backend)
    model = parts["model"]
    vocab, merges = model.get("vocab"), model.get("merges")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not isinstance(merges, list):
        return {"backend": backend}, None
    if list(vocab) != pieces[: len(vocab)] or list(vocab.values()) != list(range(len(vocab))):
        return {"backend": backend}, None
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in merges):
        return {"backend": backend}, None  # an older JSON's "a b" strings
    ids = array("i", [vocab[token] for pair in merges for token in pair])
    bpe = {"vocab": len(vocab), "merges": base64.b64encode(ids.tobytes()).decode()}
    shell = json.dumps({**parts, "model": {**model, "vocab": {}, "merges": []}})
    try:
        built = _bpe_backend(shell, bpe, pieces)
    except Exception:  # noqa: BLE001 - an option this tokenizers' BPE does not take: the JSON
        return {"backend": backend}, None
    if built.to_str() != backend:
        return {"backend": backend}, None
    return {"backend": shell, "bpe": bpe}, built


def _bpe_backend(shell: str, bpe: dict, pieces: list[str | None]) -> tokenizers.Tokenizer:
    """_fast_form's tokenizer: the BPE model built from its vocabulary and merges, with the
    normalizer, pre-tokenizer, post-processor, decoder and added tokens of ``shell`` (the JSON
    without the vocabulary and merges: read in a millisecond)."""
    parts = json.loads(shell)
    options = {k: v for k, v in parts["model"].items() if k not in ("type", "vocab", "merges")}
    model = tokenizers.models.BPE(
        dict(zip(pieces[: bpe["vocab"]], range(bpe["vocab"]))),
        _merges(bpe["merges"], pieces),
        **{k: v for k, v in options.items() if v is not None},  # None: BPE's own default
    )
    tokenizer = tokenizers.Tokenizer(model)
    # the other parts, as the JSON has them: read by tokenizers from it, with an empty model
    rest = tokenizers.Tokenizer.from_str(json.dumps({**parts, "added_tokens": []}))
    tokenizer.normalizer, tokenizer.pre_tokenizer = rest.normalizer, rest.pre_tokenizer
    tokenizer.post_processor, tokenizer.decoder = rest.post_processor, rest.decoder
    # in the JSON's order, as tokenizers adds them when it reads one (the ids are the model's)
    tokenizer.add_tokens([_added(token) for token in parts["added_tokens"]])
    return tokenizer


def _merges(encoded: str, pieces: list[str | None]) -> list[tuple[str, str]]:
    """The merges' pairs of pieces from their ids (int32 in this machine's byte order, as the
    prepared file is this machine's: base64 in JSON is read in milliseconds, a JSON list of 1M
    numbers in 0.13 s)."""
    ids = array("i")
    ids.frombytes(base64.b64decode(encoded, validate=True))
    tokens = map(pieces.__getitem__, ids)
    return list(zip(tokens, tokens))  # (first, second) pairs


def _added(token: dict) -> tokenizers.AddedToken:
    return tokenizers.AddedToken(
        token["content"],
        single_word=token["single_word"],
        lstrip=token["lstrip"],
        rstrip=token["rstrip"],
        normalized=token["normalized"],
        special=token["special"],
    )


@functools.cache
def _compiled(template: str):
    """The template in transformers' environment: a sandbox with trim_blocks, lstrip_blocks and
    loop controls, ``tojson`` without HTML escaping, ``raise_exception`` and ``strftime_now``."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` (transformers marks assistant text with it):
        its body, rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
