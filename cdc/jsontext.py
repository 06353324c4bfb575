"""JSON text kept exactly: validation and member spans, never re-encoding.

Guarantees:

* :func:`object_error` says whether bytes are one JSON object (RFC 8259,
  without NaN/Infinity) and never changes them: numbers of any size or
  precision (``18446744073709551616``, ``1.5e400``,
  ``0.10000000000000000000001``) are accepted as written, because a number is
  only ever *checked*, never converted to a float and written back.
* :func:`object_members` splits a JSON object into ``member -> exact text``
  (each value as a slice of the input), so a member such as a logical
  message's ``payload`` is passed on byte for byte.
* The common case costs one C parse (orjson); the exact, slower check runs only
  for what orjson declines (numbers outside a double).
* One depth rule for every payload (:func:`too_deep`): a text whose arrays and
  objects nest deeper than :data:`MAX_DEPTH` is declined with :data:`TOO_DEEP`
  as its reason, valid JSON or not - by :func:`object_error` (the full decoder,
  the recovery), by the relay's fast path, which checks a ``jsonb`` payload with
  :func:`too_deep` alone (its text is valid JSON by construction), and by the
  router for a logical message's ``payload`` member. A text of at most
  :data:`MAX_DEPTH` bytes is never too deep: a small payload costs one length test.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

#: The deepest nesting of arrays and objects a payload may have. Parsers recurse
#: per level and stop at their own limits: Python's json at about 950 (less the
#: caller's stack), orjson at 1,024, Jackson at 1,000 (2.15+); 512 stays clear of
#: all of them with room for the caller's stack, so a payload the relay publishes
#: is one its consumers can parse, and the relay's own exact check never hits a
#: recursion limit.
MAX_DEPTH = 512

#: The reason a text nested deeper than :data:`MAX_DEPTH` is declined.
TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep"

#: A string (with its escapes, perhaps unterminated) or a bracket: the tokens that
#: decide the depth of a JSON text.
_DEPTH_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[{\]}]', re.S)

_WS = re.compile(r"[ \t\n\r]*")
_loads, _JSONDecodeError = orjson.loads, orjson.JSONDecodeError


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name} is not a JSON number")


#: Python's decoder with every number kept as its text (no float, no int
#: conversion: exact, and no cost for a 10,000-digit integer) and NaN/Infinity refused.
_EXACT = json.JSONDecoder(parse_float=str, parse_int=str, parse_constant=_refuse_constant)


def too_deep(text: bytes) -> bool:
    """Whether ``text`` nests arrays and objects deeper than :data:`MAX_DEPTH`
    (brackets outside strings; any bytes, valid JSON or not).

    Each level takes a byte, so a text of at most ``MAX_DEPTH`` bytes, or with
    at most that many opening brackets, is answered without a scan."""
    if len(text) <= MAX_DEPTH or text.count(b"[") + text.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for token in _DEPTH_TOKENS.finditer(text):
        first = token.group()[0]
        if first == 0x5B or first == 0x7B:  # noqa: PLR1714 - '[' or '{'
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif first != 0x22:  # ']' or '}' ('"': a string)
            depth -= 1
    return False


def object_error(text: bytes) -> str | None:
    """None when ``text`` is one JSON object, else why not (one line: ``not JSON: ...``,
    ``not a JSON object`` or :data:`TOO_DEEP`)."""
    if len(text) > MAX_DEPTH and too_deep(text):
        return TOO_DEEP
    try:
        return None if _loads(text).__class__ is dict else "not a JSON object"
    except _JSONDecodeError:
        pass
    try:
        members = object_members(text.decode())
    except UnicodeDecodeError as exc:
        return f"not JSON: not valid UTF-8: {exc}"
    except ValueError as exc:
        return str(exc)
    del members
    return None


def object_members(text: str) -> dict[str, tuple[Any, str]]:
    """``member -> (parsed value, exact text)`` of the JSON object ``text``.

    Parsed values keep numbers as their text (``"1.50"``); the exact text is
    the slice of ``text`` the value occupies. A repeated member keeps its last
    occurrence, as ``jsonb`` does. Raises ``ValueError`` with the reason when
    ``text`` is not one JSON object (:data:`TOO_DEEP` when it nests deeper than
    Python's parser can follow; a caller applies the rule to the member it passes on).
    """
    end = len(text)
    i = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if i >= end or text[i] != "{":
        _finish(text, _value(text, i)[1], {})  # raises "not JSON: ..." unless one value
        raise ValueError("not a JSON object")
    members: dict[str, tuple[Any, str]] = {}
    i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
    if i < end and text[i] == "}":
        return _finish(text, i + 1, members)
    while True:
        if i >= end or text[i] != '"':
            raise ValueError(f"not JSON: expected a member name at char {i}")
        name, i = _value(text, i)
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        if i >= end or text[i] != ":":
            raise ValueError(f"not JSON: expected ':' at char {i}")
        start = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
        value, i = _value(text, start)
        members[name] = (value, text[start:i])
        i = _WS.match(text, i).end()  # type: ignore[union-attr]
        if i < end and text[i] == "}":
            return _finish(text, i + 1, members)
        if i >= end or text[i] != ",":
            raise ValueError(f"not JSON: expected ',' or '}}' at char {i}")
        i = _WS.match(text, i + 1).end()  # type: ignore[union-attr]


def _value(text: str, at: int) -> tuple[Any, int]:
    try:
        return _EXACT.raw_decode(text, at)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    except RecursionError:  # (not at MAX_DEPTH or less, unless the caller's stack is deep)
        raise ValueError(TOO_DEEP) from None


def _finish(text: str, at: int, members: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]]:
    if _WS.match(text, at).end() != len(text):  # type: ignore[union-attr]
        raise ValueError(f"not JSON: extra data at char {at}")
    return members
