"""The wire format of a request: origins, the request's bytes, the response as a value.

Pure (no I/O, no clock), tested on bytes. Guarantees:

- A request is ``METHOD target HTTP/1.1``, ``host``, the caller's headers, a
  ``content-length`` and the body. Methods and header names must be tokens,
  targets start with ``/`` and hold no whitespace or control byte, header
  values hold no CR, LF or NUL: nothing a caller passes can inject a header
  or a second request (:class:`ValueError` instead).
- ``host``, ``content-length`` and ``transfer-encoding`` are set by
  :func:`serialize_request` only: a caller cannot send them twice.
- HEAD and CONNECT are not sent through :func:`serialize_request` (their
  responses are framed differently; the tunnel writes its own ``CONNECT``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_TARGET = re.compile(r"/[\x21-\x7e]*")
#: Set by serialize_request / the pool, so a caller cannot send them twice.
_RESERVED_HEADERS = frozenset({"host", "content-length", "transfer-encoding"})


@dataclass(frozen=True, slots=True)
class Origin:
    """Where requests go: scheme, host and port, the ``Host`` header, a path prefix."""

    scheme: str
    host: str
    port: int
    authority: str  # the Host header: host[:port] as written in the URL
    path_prefix: str  # the URL's path without its trailing "/": prepended to targets


@dataclass(frozen=True, slots=True)
class Response:
    """A complete final response; ``keep_alive`` says whether its connection may be reused."""

    status: int
    headers: Mapping[str, str]  # lower-cased names
    body: bytes
    keep_alive: bool


def parse_origin(url: str) -> Origin:
    """The :class:`Origin` of an ``http://`` or ``https://`` base URL; :class:`ValueError` else."""
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"a base URL has no query, fragment or credentials: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    authority = parts.netloc.lower()
    path_prefix = parts.path.rstrip("/")
    if path_prefix and not _TARGET.fullmatch(path_prefix):
        raise ValueError(f"invalid path in base URL: {url!r}")
    return Origin(parts.scheme, parts.hostname, port, authority, path_prefix)


def encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """``name: value\\r\\n`` lines (latin-1) for :func:`serialize_request`, validated.

    Names must be tokens and must not be ``host``, ``content-length`` or
    ``transfer-encoding`` (the serializer sets them); values must not hold
    CR, LF or NUL. Encode constant headers once and reuse the bytes.
    """
    lines = []
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or name.lower() in _RESERVED_HEADERS:
            raise ValueError(f"invalid or reserved header name {name!r}")
        if not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"invalid value for header {name!r}")
        lines.append(f"{name}: {value.strip()}\r\n")
    return "".join(lines).encode("latin-1")


def serialize_request(
    method: str,
    target: str,
    *,
    authority: str,
    header_block: bytes = b"",
    body: bytes = b"",
    absolute_prefix: str = "",
) -> bytes:
    """A complete HTTP/1.1 request; ``header_block`` comes from :func:`encode_headers`.

    ``absolute_prefix`` (``http://host:port``) makes the target absolute-form,
    as a request sent to a forwarding proxy must be.
    """
    if not _TOKEN.fullmatch(method) or method in {"HEAD", "CONNECT"}:
        raise ValueError(f"unsupported method {method!r}")
    if not _TARGET.fullmatch(target):
        raise ValueError(f"invalid request target {target!r}")
    if not _TOKEN.fullmatch(authority.replace(":", "").replace("[", "").replace("]", "")):
        raise ValueError(f"invalid host {authority!r}")
    return b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
        method.encode("ascii"),
        absolute_prefix.encode("ascii"),
        target.encode("ascii"),
        authority.encode("ascii"),
        header_block,
        len(body),
        body,
    )
