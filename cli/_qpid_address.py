"""Qpid's address strings, as qpid-receive takes them: ``NAME; {OPTIONS}``.

    >>> parse_qpid_address("orders; {mode: browse}")
    ('orders', {'mode': 'browse'})
    >>> parse_qpid_address("orders")
    ('orders', {})

The options are Qpid's map syntax: ``{key: value, ...}`` with unquoted or
quoted words, numbers, nested maps and ``[lists]``. Only a trailing
``; {...}`` is read as options, so a queue name with a ``;`` elsewhere stays
whole. What the options mean is the caller's to decide; this module only
reads them, and refuses text that is not such a map, saying where.
"""

from __future__ import annotations

import re
from typing import Any

_OPTIONS = re.compile(r"^(?P<name>.*?)\s*;\s*(?P<options>\{.*\})\s*$", re.DOTALL)
_TOKEN = re.compile(r"""\s*(?:(?P<punct>[{}\[\]:,])|'(?P<sq>[^']*)'|"(?P<dq>[^"]*)"|(?P<word>[^\s{}\[\]:,'"]+))""")


class AddressOptionsError(ValueError):
    """An address whose options are not a Qpid map; the message says where it went wrong."""


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            raise AddressOptionsError(f"cannot read the address options at {text[pos:pos + 20]!r}")
        if m.group("punct"):
            out.append(("punct", m.group("punct")))
        elif m.group("sq") is not None or m.group("dq") is not None:
            out.append(("value", m.group("sq") if m.group("sq") is not None else m.group("dq")))
        else:
            word = m.group("word")
            out.append(("value", int(word) if re.fullmatch(r"-?\d+", word) else
                        {"true": True, "false": False}.get(word.lower(), word)))
        pos = m.end()
    return out


class _Reader:
    def __init__(self, tokens: list[tuple[str, Any]]) -> None:
        self.tokens = tokens
        self.i = 0

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, punct: str | None = None) -> tuple[str, Any]:
        token = self.peek()
        if token is None:
            raise AddressOptionsError("the address options end too soon (a '}' or ']' missing?)")
        if punct is not None and token != ("punct", punct):
            raise AddressOptionsError(f"expected {punct!r} in the address options, got {token[1]!r}")
        self.i += 1
        return token

    def value(self) -> Any:
        kind, value = self.take()
        if kind == "value":
            return value
        if value == "{":
            return self.mapping()
        if value == "[":
            return self.sequence()
        raise AddressOptionsError(f"unexpected {value!r} in the address options")

    def mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while self.peek() != ("punct", "}"):
            kind, key = self.take()
            if kind != "value" or type(key) is not str:
                raise AddressOptionsError(f"expected a key in the address options, got {key!r}")
            self.take(":")
            out[key] = self.value()
            if self.peek() == ("punct", ","):
                self.take(",")
            elif self.peek() != ("punct", "}"):
                raise AddressOptionsError(f"expected ',' or '}}' after {key!r} in the address options")
        self.take("}")
        return out

    def sequence(self) -> list[Any]:
        out: list[Any] = []
        while self.peek() != ("punct", "]"):
            out.append(self.value())
            if self.peek() == ("punct", ","):
                self.take(",")
        self.take("]")
        return out


def parse_qpid_address(text: str) -> tuple[str, dict[str, Any]]:
    """The node name and the options of a Qpid address.

    Args:
      text: ``NAME`` or ``NAME; {OPTIONS}``.

    Returns:
      (name, options): options is empty when there are none.

    Raises:
      AddressOptionsError: if the part after ``;`` is not a Qpid map.
    """
    m = _OPTIONS.match(text)
    if m is None:
        if re.search(r";\s*\{", text):
            raise AddressOptionsError("the address options after ';' do not end with '}'")
        return text, {}
    reader = _Reader(_tokens(m.group("options")))
    reader.take("{")
    options = reader.mapping()
    if reader.peek() is not None:
        raise AddressOptionsError(f"unexpected {reader.peek()[1]!r} after the address options")  # type: ignore[index]
    return m.group("name"), options
