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
* whatever that call raises, or a list that is not of ``(name, value)`` pairs,
  gives ``None`` (the record's headers cannot be read), never an exception. (On
  the generic call path a list comes back only whole: a name that is not UTF-8
  raises there instead of leaving a NULL in it.)
"""

from __future__ import annotations

import operator
from typing import Any

#: ``message.headers()`` through the C API, which checks the call's result (see
#: :data:`sinks.core.delivery._HEADERS` for why a plain method call is not used).
_HEADERS = operator.methodcaller("headers")

Headers = dict[str, bytes | None]


def read_headers(message: Any) -> Headers | None:
    """The headers of a confluent-kafka ``Message`` by name (the last of duplicates wins,
    as Kafka's ``lastHeader``), read once; ``None`` when they cannot be read."""
    try:
        raw = _HEADERS(message)
        return dict(raw) if raw else {}
    except Exception:  # SystemError(UnicodeDecodeError), or whatever a fix raises
        return None
