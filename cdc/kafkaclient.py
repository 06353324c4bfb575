"""Kafka reads librdkafka cannot do safely as-is, and the first contact of a command.

Guarantees:

* :class:`CommittedReader` reads a consumer group's committed offsets with a
  consumer handle whose ``group.id`` is that group and which never subscribes:
  it sends OffsetFetch to the group's coordinator, never JoinGroup, never
  commits, and leaves no member behind. It is **the** way to read committed
  offsets in this project: ``AdminClient.list_consumer_group_offsets`` crashes
  the process (SIGSEGV in librdkafka's ``rdk:main`` thread, ``segfault at 58``)
  when the coordinator answers NOT_COORDINATOR or COORDINATOR_NOT_AVAILABLE, as
  a broker that just started does: librdkafka then asks the client's own
  consumer group to re-query its coordinator, and an AdminClient (a producer
  handle) has none - a NULL pointer (librdkafka issue #5040, open up to at
  least 2.16). A consumer handle always has its group, so the same answer only
  makes it look the coordinator up again;
* :func:`first_contact` asks a client for the cluster's metadata with a short
  timeout (:data:`FIRST_CONTACT_TIMEOUT_S`) so a command pointed at a dead or
  wrong address fails within seconds, with one line naming the failure:
  ``Kafka at <bootstrap> unreachable: <what failed>``. What failed is found by
  :func:`diagnose` (a TCP connect of its own: refused, silent, or connected but
  mute); the line names ``KAFKA_BOOTSTRAP_SERVERS`` only when the setting itself
  is the likely fault (an address that does not parse or a host that does not
  resolve) - a right setting with a stopped broker is not a wrong setting;
* every client here is built from the caller's configuration, which carries
  :meth:`cdc.kafkalog.KafkaClientEvents.config` (rate-limited errors and logs).
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from cdc.errors import KafkaUnreachableError

#: The first metadata request of a command gives up after this: a reachable
#: broker answers in milliseconds, even one that has just started.
FIRST_CONTACT_TIMEOUT_S = 5.0
#: :func:`diagnose`'s own TCP connect gives up after this.
DIAGNOSE_CONNECT_TIMEOUT_S = 1.0
#: Group readers kept open at once by one :class:`CommittedReader` (least recent closed).
MAX_GROUP_READERS = 16


def first_contact(
    client: Any, bootstrap: str, *, timeout_s: float = FIRST_CONTACT_TIMEOUT_S
) -> Any:
    """The cluster's metadata from ``client`` (a Consumer, Producer or AdminClient);
    :class:`KafkaUnreachableError` saying what failed when none comes."""
    try:
        return client.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise unreachable(bootstrap, exc) from exc


def unreachable(bootstrap: str, exc: BaseException) -> KafkaUnreachableError:
    """The one-line error of a Kafka that did not answer: what failed, found by :func:`diagnose`."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    reason = err.str() if err is not None and hasattr(err, "str") else str(exc)
    return KafkaUnreachableError(f"Kafka at {bootstrap} unreachable: {diagnose(bootstrap, reason)}")


def diagnose(bootstrap: str, reason: str) -> str:
    """What failed between here and the first bootstrap address, in words.

    librdkafka says only "Broker transport failure" for a stopped broker, a wrong
    port and a firewall alike: one TCP connect of our own tells them apart. The
    setting is named only when it is the likely fault.
    """
    first = bootstrap.split(",", maxsplit=1)[0].strip()
    first = first.split("://", 1)[-1]  # SSL://host:port, PLAINTEXT://...
    host, sep, port_text = first.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return f"{reason} ({first!r} is not host:port: check KAFKA_BOOTSTRAP_SERVERS)"
    port = int(port_text)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return f"host {host} does not resolve (check KAFKA_BOOTSTRAP_SERVERS)"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(DIAGNOSE_CONNECT_TIMEOUT_S)
        try:
            sock.connect(address)
        except ConnectionRefusedError:
            return f"connection refused at {host}:{port} (is the broker running?)"
        except TimeoutError:
            return f"no TCP answer from {host}:{port} in {DIAGNOSE_CONNECT_TIMEOUT_S:g}s"
        except OSError as exc:
            return f"{host}:{port}: {exc.strerror or exc}"
    return (
        f"{host}:{port} accepts connections but Kafka did not answer ({reason}):"
        " a broker still starting, another service on that port, or a security protocol"
        " that differs (KAFKA_CONFIG_SECURITY_PROTOCOL)"
    )


class CommittedReader:
    """Committed offsets of consumer groups, one never-joining consumer per group (thread-safe).

    ``config`` is a consumer configuration without ``group.id`` (bootstrap,
    security, ``error_cb``/``logger``). Close it when done.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._lock = threading.Lock()
        self._readers: OrderedDict[str, Consumer] = OrderedDict()

    def committed(
        self, group: str, tps: Sequence[tuple[str, int]], *, timeout_s: float
    ) -> dict[tuple[str, int], int | None]:
        """``group``'s committed offset per partition (``None`` where it never committed).

        Raises ``KafkaException`` when Kafka does not answer in ``timeout_s`` or
        refuses a partition."""
        if not tps:
            return {}
        with self._lock:
            consumer = self._reader(group)
            found = consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=timeout_s)
        out: dict[tuple[str, int], int | None] = dict.fromkeys(tps)
        for tp in found:
            if tp.error is not None:
                raise KafkaException(tp.error)
            out[(str(tp.topic), int(tp.partition))] = None if tp.offset < 0 else int(tp.offset)
        return out

    def _reader(self, group: str) -> Consumer:
        consumer = self._readers.get(group)
        if consumer is None:
            consumer = Consumer(
                {
                    **self._config,
                    "group.id": group,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                }
            )
            self._readers[group] = consumer
            while len(self._readers) > MAX_GROUP_READERS:
                self._readers.popitem(last=False)[1].close()
        self._readers.move_to_end(group)
        return consumer

    def close(self) -> None:
        with self._lock:
            while self._readers:
                self._readers.popitem()[1].close()
