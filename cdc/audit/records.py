"""Reading a Kafka record's headers defensively, for the audit.

The one reader of the project is being moved into ``cdc`` (``cdc.records``,
issue 34; today :func:`sinks.core.delivery.read_headers`, which ``cdc`` may not
import). Until then this module keeps its semantics, and the audit calls only
:func:`read_headers` here: pointing it at ``cdc.records`` is a one-line change.

Guarantees (the sink's reader's):

* ``message.headers()`` is called once per message, through the C API's generic
  call path (:data:`_HEADERS`), never again afterwards: confluent-kafka leaves a
  NULL in the list of a header name that is not UTF-8, and a second call, its
  repr or an iteration of it, is a SIGSEGV;
* whatever that call raises or returns that is not a list of ``(str, bytes|None)``
  pairs gives ``None`` (the record's headers cannot be read), never an exception.
"""

from __future__ import annotations

import operator
from typing import Any

#: ``message.headers()`` through the C API, which checks the call's result (see
#: :data:`sinks.core.delivery._HEADERS` for why a plain method call is not used).
_HEADERS = operator.methodcaller("headers")

Headers = list[tuple[str, bytes | None]]


def read_headers(message: Any) -> Headers | None:
    """The headers of a confluent-kafka ``Message``, read once; ``None`` when unreadable."""
    try:
        raw = _HEADERS(message)
    except Exception:  # SystemError(UnicodeDecodeError), or whatever a fix raises
        return None
    if not raw:
        return []
    if not isinstance(raw, list):
        return None
    for item in raw:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            return None
        if not isinstance(item[1], bytes | None):
            return None
    return raw
