"""The transport's failures: one class per way a request can fail, one line for a log.

Guarantees:

- Every failure is a :class:`TransportError` whose class says what happened
  (:class:`ConnectError`, :class:`ConnectTimeout`, :class:`ReadTimeout`,
  :class:`WriteTimeout`, :class:`ReadError`, :class:`RemoteProtocolError`)
  and whose message says it for a log line; e.g.
  ``[Errno 111] Connection refused (127.0.0.1:8081)``
  (:func:`describe_os_error`).
- Any TLS failure, in the handshake or later (a server's alert such as
  "certificate required"), is a :class:`TLSError` carrying the
  :class:`ssl.SSLError`; a refused ``CONNECT`` is a :class:`ProxyError` with
  the status.
- The engine client maps these at its boundary to :mod:`sinks.core.errors`;
  nothing above :mod:`sinks.engine` sees them.
"""

from __future__ import annotations

import os
import re
import ssl

_ERRNO = re.compile(r"\[Errno (-?\d+)\]")


class TransportError(Exception):
    """No usable response: the class names the failure, the message is for a log line."""


class ConnectError(TransportError):
    """The connection could not be made (refused, unreachable, DNS, TLS)."""


class TLSError(ConnectError):
    """The TLS handshake or session failed: an untrusted or misnamed certificate, a
    client certificate the server refused, or a server that does not speak TLS.

    ``ssl_error`` is the :class:`ssl.SSLError` (its ``reason`` names the failure),
    or ``None`` when the server reset the connection during the handshake (as
    asyncio's TLS server does when it refuses a client certificate).
    """

    def __init__(self, message: str, *, ssl_error: ssl.SSLError | None) -> None:
        super().__init__(message)
        self.ssl_error = ssl_error


class ProxyError(ConnectError):
    """The proxy refused to open a tunnel to the origin; ``status`` is its answer."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class ConnectTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The connection was not made within the connect timeout."""


class ReadTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The server was silent for the read timeout while a response was due."""


class WriteTimeout(TransportError):  # noqa: N818 - httpx's names, kept in reasons
    """The request could not be written within the write timeout."""


class RequestDeadline(TransportError):  # noqa: N818 - named like the timeouts above
    """No complete response within the request's overall deadline (a trickling answer)."""


class ReadError(TransportError):
    """The connection broke (reset, closed locally) while a response was due."""


class RemoteProtocolError(TransportError):
    """The server closed early or sent bytes that are not a valid HTTP/1.1 response."""


def describe_os_error(exc: OSError, authority: str) -> str:
    """``[Errno 111] Connection refused (host:port)`` for a failed connect.

    asyncio words a refusal ``Connect call failed``, or ``Multiple exceptions``
    when a name has several addresses: the errno they share is spelled out.
    """
    if not isinstance(exc, ssl.SSLError):  # its errno is not an OS error number
        codes = {exc.errno} if exc.errno else {int(code) for code in _ERRNO.findall(str(exc))}
        if len(codes) == 1 and (code := next(iter(codes))) > 0:
            return f"[Errno {code}] {os.strerror(code)} ({authority})"
    return f"{str(exc) or type(exc).__name__} ({authority})"
