"""A row's reply as text: the bytes its committed tokens spell, where a stop string ends it, and
how much of it may be shown while it is still growing.

Stop strings are matched on committed text only: a draft is spelled here once the target has
accepted it, so a stop string inside a draft that a later round rejects never ends a reply.
Under a constraint a stop string ends the reply only where the constraint accepts the text
before it as complete (a stop string inside a JSON string value does not cut the JSON short):
the reply is then that text, which the constraint accepts, with finish_reason "stop".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..constraints import Constraint, TokenVocabulary

# OpenAI's limit on stop strings per request.
MAX_STOP_STRINGS = 4


def stop_problem(stop) -> str | None:
    """What is wrong with ``stop`` (None, a string or a list of strings), as OpenAI checks it;
    None if it is usable."""
    strings = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return None
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        return "must be a string or a list of strings"
    if len(strings) > MAX_STOP_STRINGS:
        return f"has {len(strings)} strings: at most {MAX_STOP_STRINGS} are allowed"
    if any(s == "" for s in strings):
        return "holds an empty string, which would end every reply before it starts: remove it"
    return None


def stop_strings(stop) -> tuple[bytes, ...]:
    """``stop`` (checked by stop_problem) as the UTF-8 byte strings matched on the reply."""
    strings = () if stop is None else [stop] if isinstance(stop, str) else stop
    return tuple(dict.fromkeys(s.encode() for s in strings))


@dataclass
class ReplyText:
    """A row's committed output as bytes, and where a stop string ended it (``end``)."""

    vocab: TokenVocabulary
    constraint: Constraint
    stop: tuple[bytes, ...] = ()
    data: bytearray = field(default_factory=bytearray)  # the bytes of every committed token
    end: int | None = None  # the reply's length in bytes once a stop string ended it
    sent: int = 0  # bytes handed out by ``unsent``

    def extend(self, committed: list[int]) -> list[int]:
        """Spell a round's committed tokens; returns them cut after the token that completes
        the first stop string that may end the reply (then ``end`` is set), else all of them."""
        for i, token in enumerate(committed):
            before = len(self.data)
            self.data += self.vocab.output_bytes([token])
            if self.stop and (at := self._first_stop(before)) is not None:
                self.end = at
                return committed[: i + 1]
        return committed

    def _first_stop(self, new_from: int) -> int | None:
        """Where the first stop string ending in the bytes from ``new_from`` on starts, among
        those the constraint lets the reply end before (earlier matches were judged already)."""
        base = max(0, new_from - max(map(len, self.stop)) + 1)  # only this tail can hold one
        tail = bytes(self.data[base:])
        starts = sorted(
            base + at
            for s in self.stop
            for at in _occurrences(tail, s, max(0, new_from - base - len(s) + 1))
            if base + at + len(s) > new_from
        )
        return next((at for at in starts if self._may_end(bytes(self.data[:at]))), None)

    def _may_end(self, text: bytes) -> bool:
        try:
            return self.constraint.accepts(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):  # a split character, a byte with no token
            return False

    @property
    def text(self) -> bytes:
        """The reply: all the committed bytes, or those before the stop string that ended it."""
        return bytes(self.data if self.end is None else self.data[: self.end])

    def unsent(self, finished: bool) -> bytes:
        """The reply's bytes not handed out yet that may be shown now: while it runs, not the
        tail that might begin a stop string (a later token may complete it, and then it is not
        part of the reply)."""
        end = len(self.data) if self.end is None else self.end
        if not finished and self.end is None and self.stop:
            tail = bytes(self.data[-max(map(len, self.stop)) :])  # what a stop's start can be in
            end -= max(held_prefix(tail, s) for s in self.stop)
        out, self.sent = bytes(self.data[self.sent : end]), max(self.sent, end)
        return out


def _occurrences(data: bytes, s: bytes, start: int):
    at = data.find(s, start)
    while at != -1:
        yield at
        at = data.find(s, at + 1)


def held_prefix(data, s) -> int:
    """The length of the longest proper prefix of ``s`` that ``data`` ends with (0 if none):
    what a stream holds back while it may be the start of ``s`` (bytes or str)."""
    return next((k for k in range(min(len(s) - 1, len(data)), 0, -1) if data.endswith(s[:k])), 0)
