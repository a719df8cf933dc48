"""What a queue, exchange or user name may hold, and how a string a client
chose is written into a log line.

A name is 1 to 255 bytes of UTF-8 (the limit of AMQP 0-10's str8, which Qpid
and RabbitMQ keep) with no control character: a newline in a name would let
a client forge whole lines in the broker's log, and a terminal escape would
act on whoever reads ``qflow-stat``. Nor may it hold a bidirectional control
(U+202A-U+202E, U+2066-U+2069, the marks U+200E, U+200F, U+061C) or an
invisible one (U+200B-U+200D, U+FEFF): they make one name show as another in
the console and the tools. Names the broker already holds (recovered from a
data directory) are kept whatever they hold: the rule is applied where
a client asks for a new name, never on recovery.
"""

from __future__ import annotations

import unicodedata

from qflow.protocol.spec import INVALID_ARGUMENT, CommandError

MAX_NAME = 255  # bytes of UTF-8
# Characters that make a name show as another (a right-to-left override reverses what follows it) or
# hide in it: bidirectional embeddings, overrides, isolates and marks; zero-width space, joiners, BOM.
_SPOOFING = frozenset("\u061c\u200b\u200c\u200d\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                      "\u2066\u2067\u2068\u2069\ufeff")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a queue, exchange or user; None when it can."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if not 0 < size <= MAX_NAME:
        return f"a name must be 1 to {MAX_NAME} bytes, got {size}"
    if not name.isprintable():
        for i, ch in enumerate(name):
            if unicodedata.category(ch) == "Cc":
                return f"a name must not contain control characters ({_escape(ch)} at position {i})"
            if ch in _SPOOFING:
                return (f"a name must not contain bidirectional or invisible formatting characters "
                        f"({_escape(ch)} {unicodedata.name(ch, '')} at position {i})")
    return None


def check_name(command: str, field: str, name: str) -> None:
    """Refuse ``name`` (given in ``field`` of ``command``) with INVALID_ARGUMENT
    naming the field, unless it is a valid name."""
    problem = name_problem(name)
    if problem is not None:
        raise CommandError(INVALID_ARGUMENT, f"{command}: field {field!r}: {problem}")


def printable(text: object) -> str:
    """``text`` made safe for one log line: every non-printable character (newline,
    escape, other control and separator characters) written as a backslash escape,
    and backslashes doubled so the escapes cannot be forged either."""
    s = text if type(text) is str else str(text)
    if s.isprintable() and "\\" not in s:
        return s
    return "".join(ch if ch.isprintable() and ch != "\\" else _escape(ch) for ch in s)


def _escape(ch: str) -> str:
    if ch == "\\":
        return "\\\\"
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
