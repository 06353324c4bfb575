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
* a broker that accepts the connection but not the client (TLS, SASL) is named by
  the reason librdkafka gave (the client's :attr:`KafkaClientEvents.cause
  <cdc.kafka.log.KafkaClientEvents.cause>`), with the ``KAFKA_CONFIG_*`` setting to fix
  (:func:`explain`): a broker certificate not trusted, a client certificate refused,
  SASL credentials refused, TLS at a plaintext listener; a plaintext client at a TLS
  listener (librdkafka only sees the connection closed) is found by a TLS handshake
  of :func:`diagnose`'s own. No configured value is ever shown;
* every client here is built from the caller's configuration, which carries
  :meth:`cdc.kafka.log.KafkaClientEvents.config` (rate-limited errors and logs).
"""

from __future__ import annotations

import re
import socket
import ssl
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from cdc.errors import KafkaUnreachableError
from cdc.kafka.log import KafkaClientEvents

#: The first metadata request of a command gives up after this: a reachable
#: broker answers in milliseconds, even one that has just started.
FIRST_CONTACT_TIMEOUT_S = 5.0
#: :func:`diagnose`'s own TCP connect gives up after this.
DIAGNOSE_CONNECT_TIMEOUT_S = 1.0
#: Group readers kept open at once by one :class:`CommittedReader` (least recent closed).
MAX_GROUP_READERS = 16


#: librdkafka's reasons (a pattern of its text), and the ``KAFKA_CONFIG_*`` setting each
#: one points at (the first that matches).
_FIXES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), fix)
    for pattern, fix in (
        (
            r"certificate verify failed",
            "the broker's certificate is not trusted (or names another host):"
            " set KAFKA_CONFIG_SSL_CA_LOCATION to the CA that signed it",
        ),
        (
            r"alert (bad certificate|certificate required)",
            "the broker refused the client's certificate (none sent, or not signed by a CA"
            " it trusts): set KAFKA_CONFIG_SSL_CERTIFICATE_LOCATION and"
            " KAFKA_CONFIG_SSL_KEY_LOCATION",
        ),
        (r"alert unknown ca", "the broker does not trust the client certificate's CA"),
        (
            r"PLAINTEXT broker listener|closed by peer.*state SSL_HANDSHAKE",
            "the listener does not speak TLS: KAFKA_CONFIG_SECURITY_PROTOCOL must match"
            " it (PLAINTEXT or SASL_PLAINTEXT)",
        ),
        (
            r"SASL authentication error",
            "check KAFKA_CONFIG_SASL_MECHANISM, KAFKA_CONFIG_SASL_USERNAME and"
            " KAFKA_CONFIG_SASL_PASSWORD",
        ),
    )
)
#: ``ssl://host:port/bootstrap: `` or ``sasl_ssl://host:port/1: `` before librdkafka's reason.
_BROKER_PREFIX = re.compile(r"^\S+://\S+?/\S+?: ")
#: `` (after 3ms in state SSL_HANDSHAKE)`` after it, and OpenSSL's ``error:0A000086:``.
_NOISE = re.compile(r" \(after \d+ms in state \w+\)|error:[0-9A-F]{8}:SSL routines::")
#: librdkafka's own advice after a failed verification (we name the variable instead), and
#: its guess about a plaintext listener (we say it).
_RDKAFKA_ADVICE = re.compile(
    r": broker certificate could not be verified, .*$|: connecting to a PLAINTEXT broker listener\?"
)


def first_contact(
    client: Any,
    bootstrap: str,
    *,
    timeout_s: float = FIRST_CONTACT_TIMEOUT_S,
    events: KafkaClientEvents | None = None,
    security_protocol: str = "plaintext",
) -> Any:
    """The cluster's metadata from ``client`` (a Consumer, Producer or AdminClient);
    :class:`KafkaUnreachableError` saying what failed when none comes.

    ``events`` (the client's :class:`KafkaClientEvents`) gives librdkafka's reason;
    ``security_protocol`` is the client's (``KAFKA_CONFIG_SECURITY_PROTOCOL``)."""
    try:
        return client.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise unreachable(
            bootstrap, exc, cause=served_cause(client, events), security_protocol=security_protocol
        ) from exc


def served_cause(client: Any, events: KafkaClientEvents | None) -> tuple[str, str] | None:
    """The client's :attr:`~cdc.kafka.log.KafkaClientEvents.cause` once the error
    callbacks librdkafka queued are served (they are, only by ``poll``)."""
    if events is None:
        return None
    client.poll(0)
    return events.cause


def unreachable(
    bootstrap: str,
    exc: BaseException,
    *,
    cause: tuple[str, str] | None = None,
    security_protocol: str = "plaintext",
) -> KafkaUnreachableError:
    """The one-line error of a Kafka that did not answer: what failed, found by :func:`diagnose`."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    reason = err.str() if err is not None and hasattr(err, "str") else str(exc)
    found = diagnose(bootstrap, reason, cause=cause, security_protocol=security_protocol)
    return KafkaUnreachableError(f"Kafka at {bootstrap} unreachable: {found}")


def explain(text: str) -> str | None:
    """librdkafka's reason for a refused client (an ``error_cb`` text), trimmed, with the
    setting that fixes it; None when it is not a refusal :data:`_FIXES` knows (e.g. a
    refused connect: the broker was down, which :func:`diagnose` finds for itself)."""
    for pattern, fix in _FIXES:
        if pattern.search(text):
            trimmed = _NOISE.sub("", _BROKER_PREFIX.sub("", text))
            return f"{_RDKAFKA_ADVICE.sub('', trimmed).strip()}: {fix}"
    return None


def diagnose(
    bootstrap: str,
    reason: str,
    *,
    cause: tuple[str, str] | None = None,
    security_protocol: str = "plaintext",
) -> str:
    """What failed between here and the first bootstrap address, in words.

    librdkafka says only "Broker transport failure" for a stopped broker, a wrong
    port and a firewall alike: one TCP connect of our own tells them apart. The
    setting is named only when it is the likely fault. A broker that accepts the
    connection but not the client is named by ``cause`` (librdkafka's reason), or -
    a plaintext client, no reason - by a TLS handshake of our own.
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
    return _probe(host, port, infos[0], reason, cause=cause, security_protocol=security_protocol)


def _probe(
    host: str,
    port: int,
    info: tuple[Any, ...],
    reason: str,
    *,
    cause: tuple[str, str] | None,
    security_protocol: str,
) -> str:
    """:func:`diagnose` once the address resolved: connect, and say what answered."""
    family, kind, proto, _, address = info
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(DIAGNOSE_CONNECT_TIMEOUT_S)
        failed = _connect(sock, address, f"{host}:{port}")
        if failed:
            return failed
        refusal = explain(cause[1]) if cause is not None else None
        if refusal is not None:
            return f"{host}:{port} accepts connections but not this client: {refusal}"
        if "SSL" not in security_protocol.upper() and speaks_tls(sock):
            return (
                f"{host}:{port} is a TLS listener and the client speaks plaintext:"
                " set KAFKA_CONFIG_SECURITY_PROTOCOL=SSL (or SASL_SSL) and"
                " KAFKA_CONFIG_SSL_CA_LOCATION"
            )
    return (
        f"{host}:{port} accepts connections but Kafka did not answer ({reason}):"
        " a broker still starting, another service on that port, or a security protocol"
        " that differs (KAFKA_CONFIG_SECURITY_PROTOCOL)"
    )


def _connect(sock: socket.socket, address: Any, where: str) -> str:
    """Connect ``sock``; what failed, in words, or "" when it connected."""
    try:
        sock.connect(address)
    except ConnectionRefusedError:
        return f"connection refused at {where} (is the broker running?)"
    except TimeoutError:
        return f"no TCP answer from {where} in {DIAGNOSE_CONNECT_TIMEOUT_S:g}s"
    except OSError as exc:
        return f"{where}: {exc.strerror or exc}"
    return ""


def speaks_tls(sock: socket.socket) -> bool:
    """Whether the server at the other end of ``sock`` answers a TLS handshake (its
    certificate unchecked: this only asks which protocol the port speaks)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(sock, do_handshake_on_connect=False) as tls:
            tls.do_handshake()
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()  # a TLS peer refused us
    except OSError:
        return False
    return True


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
