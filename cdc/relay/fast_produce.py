"""The relay's produce call in C (:mod:`cdc.relay._produce`), where it can be used.

``Producer.produce`` costs the relay 28% of its main thread on 100-event
transactions (callgrind), 15% of it turning each header name into a new bytes
object. The compiled call hands the same record - topic, key, value,
timestamp, the same headers in the same order - to the same librdkafka
producer, with the per-message state confluent-kafka's delivery-report
callback expects, so reports, failures and acknowledgements go exactly the way
they go for ``Producer.produce`` (``cdc.relay.producing.Reports``).

:func:`bind` returns it only when all of these hold, else ``None`` and the
relay calls ``Producer.produce``:

- ``OUTBOX_CDC_PURE_PYTHON`` is not set (the tests run both paths);
- the extension was built (a C compiler where the package was installed);
- confluent-kafka is a 2.x at least 2.6 (the supported range; its ``Handle``
  and per-message state were read in 2.16.1's source, and have kept that layout
  since long before 2.6);
- exactly one librdkafka is mapped into the process (the one confluent-kafka
  loaded), and it exports what the call needs;
- the name librdkafka gave the producer's handle, read through the layout, is
  the producer's ``client.id`` followed by ``#producer-``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer

from cdc import constants as c
from cdc.wal.pgoutput import PURE_PYTHON_VAR

log = logging.getLogger(__name__)

#: librdkafka's error code for a full local queue (``BufferError`` from ``produce``).
ERR_QUEUE_FULL = -184

#: produce(producer, topic, value, key, timestamp_ms, event_id, event_type,
#: aggregatetype, tx_headers, traceparent, reports) -> 0 or librdkafka's error code
FastProduce = Callable[..., int]


def _confluent_version() -> str:
    return importlib.metadata.version("confluent-kafka")


def _librdkafka_path() -> str | None:
    """The one librdkafka file mapped into this process, if exactly one is."""
    paths = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if re.search(r"/librdkafka[^/]*\.so", path):
                    paths.add(path)
    except OSError:
        return None
    return paths.pop() if len(paths) == 1 else None


@functools.cache
def _module() -> Any:
    """The initialised extension, or None (why is logged once)."""
    module, why_not = _load()
    if module is None:
        log.info("relay produce call: confluent-kafka's (%s)", why_not)
    return module


def _load() -> tuple[Any, str]:
    if os.environ.get(PURE_PYTHON_VAR, "").strip() in ("1", "true", "yes"):
        return None, f"{PURE_PYTHON_VAR} is set"
    try:
        module = importlib.import_module("cdc.relay._produce")
    except ImportError:
        return None, "the C extension is not built"
    version = _confluent_version()
    major, minor = (int(part) for part in version.split(".")[:2])
    if major != 2 or minor < 6:
        return None, f"confluent-kafka {version} is not 2.6 or later 2.x"
    path = _librdkafka_path()
    if path is None:
        return None, "not exactly one librdkafka is mapped into the process"
    try:
        module.init(
            path,
            Producer,
            (c.HEADER_ID, c.HEADER_TYPE, c.HEADER_AGGREGATE_TYPE, c.HEADER_TRACEPARENT),
        )
    except ImportError as exc:
        return None, str(exc)
    return module, ""


def bind(producer: object, client_id: str) -> FastProduce | None:
    """The compiled produce call for ``producer`` (whose ``client.id`` is
    ``client_id``), or None where ``Producer.produce`` must be used."""
    module = _module()
    if module is None or type(producer) is not Producer:
        return None
    name = module.name(producer)
    if not isinstance(name, str) or not name.startswith(f"{client_id}#producer-"):
        log.warning(
            "relay produce call: confluent-kafka's (the producer's handle reads %r, not"
            " %r: confluent-kafka %s is laid out otherwise)",
            name,
            f"{client_id}#producer-",
            _confluent_version(),
        )
        return None
    return module.produce  # type: ignore[no-any-return]
