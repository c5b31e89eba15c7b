"""A prepared model's tokenizer on the `tokenizers` library alone: what the package reads off a
transformers fast tokenizer (ids ↔ text, special and added tokens, the chat template), without
importing transformers (≈ 0.5 s) or building its tokenizer (≈ 0.6 s for SmolLM2's) on each start.

``Tokenizer.of(transformers_tokenizer)`` takes it once, when a model is prepared; the state it
keeps is plain values, stored in the prepared file (target.prepared). The chat template renders
as transformers renders it: the same Jinja sandbox and options, helpers and special-token
variables (a test compares both on the shipped templates, tools included).
"""

from __future__ import annotations

import functools
import json
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
        state = {
            "backend": tokenizer.backend_tokenizer.to_str(),
            # each id's piece, read for the vocabulary's bytes at every load (one backend call
            # per id: 0.34 s for Gemma's 262k tokens)
            "pieces": tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))),
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
        return cls.from_state(state)

    @classmethod
    def from_state(cls, state: dict) -> Tokenizer:
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
        if self._pieces is not None and all(0 <= i < len(self._pieces) for i in ids):
            return [self._pieces[i] for i in ids]
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
