"""The one defensive reader of consumed Kafka records, for the relay, the ops commands and the sink.

Every record is data: any producer on a shared topic can write any bytes
(header names that are not UTF-8, null values, duplicate names, no headers at
all). Guarantees:

* :func:`read_headers` calls a message's ``headers()`` exactly once, through
  the generic call path, and never raises: a record whose headers cannot be
  read comes back with the reason in :attr:`HeaderRead.problem` (the message's
  headers must not be touched again afterwards - see the function);
* :class:`RecordReader` reads a record into a :class:`Record` (topic,
  partition, offset, timestamp, headers by name) or skips it, counting the
  skip under a reason from a fixed set (:class:`Skip`): a reason is a metric
  label and a log word, never the record's bytes. Nothing it reads is fatal;
* the ``id`` header is parsed as a uuid into its 16 bytes (:func:`uuid_bytes`,
  :meth:`Record.event_id_bytes`): PostgreSQL's uuid text, any case, with or
  without its dashes; anything else (braces, ``urn:uuid:``, ``evt-1``) is no id.
  Callers that hold many ids keep 16 bytes each, not a Python string per record;
  the sink keeps the canonical text (:func:`canonical_id`), its idempotency key.

The sink (:mod:`sinks.core.delivery`) re-exports :func:`read_headers` and
:class:`HeaderRead`; they live here because ``cdc`` is the ground floor.
"""

from __future__ import annotations

import binascii
import enum
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

from cdc import constants as c

#: The reason prefix of a record whose headers could not be read (parking lot, dead letters).
UNREADABLE_HEADERS = "unreadable_headers"

#: Kafka headers in record order: duplicates kept, a null value as None.
HeaderList = tuple[tuple[str, bytes | None], ...]

#: Bytes of an id (a uuid).
ID_BYTES = 16
#: The canonical text of a uuid: 32 hex digits and 4 dashes.
UUID_TEXT_LEN = 36

#: confluent-kafka's TIMESTAMP_NOT_AVAILABLE timestamp type.
_KAFKA_TIMESTAMP_NOT_AVAILABLE = 0


@dataclass(frozen=True, slots=True)
class HeaderRead:
    """What :func:`read_headers` found: the headers, or why there are none to show."""

    headers: HeaderList
    #: ``""`` when the headers were read; else ``unreadable_headers: <why>``.
    problem: str = ""


#: ``message.headers()`` called through the C API, which always checks a call's result.
#: Written as a plain method call on a hot path, CPython 3.11+ specialises the call
#: site (PEP 659: ``PRECALL_NO_KW_METHOD_DESCRIPTOR_NOARGS``, ``CALL_METHOD_DESCRIPTOR_NOARGS``
#: later) and the specialised instruction does *not* check that a C function returning
#: a value left no exception set: the broken list of a non-UTF-8 header name then comes
#: back as if it were fine - no SystemError - and the next unpacking of its NULL is a
#: SIGSEGV. The generic call path (``_Py_CheckFunctionResult``) turns it into SystemError.
_HEADERS = operator.methodcaller("headers")


def read_headers(message: Any) -> HeaderRead:
    """The headers of a confluent-kafka ``Message``, read once and defensively.

    confluent-kafka (through 2.16 at least) decodes header *names* as UTF-8
    inside ``Message.headers()``; a name that is not valid UTF-8 (any producer
    can write one: the protocol carries bytes) makes it leave a NULL in the
    header tuple and return the list with the ``UnicodeDecodeError`` still set,
    which Python turns into ``SystemError`` - on the generic call path only
    (see :data:`_HEADERS`: a specialised call site returns the broken list). The
    broken list stays cached in the message: a *second* ``headers()`` call (or
    its repr, pickle, iteration) dereferences the NULL and kills the process
    with SIGSEGV. So this is the only place that calls ``headers()``, once per
    message, through :data:`_HEADERS`, catching whatever it raises; the
    message's headers are never touched again - the caller keeps what it got.
    """
    raw = _call_headers(message)
    if isinstance(raw, str):
        return HeaderRead((), raw)
    for item in raw:
        if not (isinstance(item, tuple) and len(item) == 2):
            return HeaderRead((), f"{UNREADABLE_HEADERS}: a header is a {type(item).__name__}")
        if not (isinstance(item[0], str) and isinstance(item[1], _VALUE_TYPES)):
            return HeaderRead((), f"{UNREADABLE_HEADERS}: {_UNEXPECTED_TYPES}")
    return HeaderRead(tuple(raw))


#: The types a header's value may have (built once: ``bytes | None`` is a new object per use).
_VALUE_TYPES = (bytes, type(None))
_UNEXPECTED_TYPES = "a header of unexpected types"


def _call_headers(message: Any) -> list[Any] | str:
    """``message.headers()`` called once (see :func:`read_headers`): what it returned
    (``[]`` for none), or the problem (``unreadable_headers: ...``) when it raised."""
    try:
        raw = _HEADERS(message)  # not message.headers(): see _HEADERS
    except Exception as exc:  # SystemError(UnicodeDecodeError), or whatever a fix raises
        cause = exc.__cause__ or exc.__context__ or exc
        return f"{UNREADABLE_HEADERS}: {_describe(cause)}"
    return raw if isinstance(raw, list) else list(raw) if raw else []


def _describe(exc: BaseException) -> str:
    """One line about why the headers could not be read (never the bytes themselves)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"a header name is not UTF-8 (byte 0x{exc.object[exc.start]:02x} at {exc.start})"
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class Skip(enum.StrEnum):
    """Why a reader passed a record by (a fixed set: metric labels, log words)."""

    UNREADABLE_HEADERS = "unreadable_headers"  # headers() failed (a non-UTF-8 name...)
    NO_ORIGIN = "no_origin"  # no `origin` header: not written by a relay that says who it is
    BAD_ORIGIN = "bad_origin"  # an `origin` header that does not parse
    FOREIGN_ORIGIN = "foreign_origin"  # another system, timeline branch or slot
    BAD_ID = "bad_id"  # no `id` header, or one that is not a uuid
    BROKER_ERROR = "broker_error"  # the consumer handed over an error instead of a record


@dataclass(slots=True)
class Record:
    """A consumed record as the relay's readers use it (no key or value: they are not read).

    Its headers are kept as the client returned them, by name, and each value's type is
    checked when it is read (:meth:`header`): an audit reads millions of records and
    looks at three headers of each. (Not frozen: a frozen dataclass's ``__init__`` costs
    as much as the rest of a record's reading.)"""

    topic: str
    partition: int
    offset: int
    #: the record's timestamp (commit time for the relay's records); None when the
    #: broker has none
    timestamp_ms: int | None
    #: by name, the last of duplicates winning (Kafka's ``lastHeader``), unchecked
    named: dict[Any, Any]

    @property
    def headers(self) -> dict[str, bytes]:
        """Every header of a text name and a bytes (or null: ``b""``) value, by name."""
        return {
            name: value or b""
            for name, value in self.named.items()
            if isinstance(name, str) and isinstance(value, _VALUE_TYPES)
        }

    def header(self, name: str) -> bytes | None:
        """The header's value (``b""`` when null); None when absent or not bytes."""
        value = self.named.get(name)
        if type(value) is bytes:
            return value
        return b"" if value is None and name in self.named else None

    def event_id_bytes(self) -> bytes | None:
        """The ``id`` header as the uuid's 16 bytes; None when missing or not a uuid."""
        return uuid_bytes(self.header(c.HEADER_ID))


def uuid_bytes(raw: bytes | None) -> bytes | None:
    """The 16 bytes of a uuid's text (``8-4-4-4-12`` or 32 hex digits, any case); None
    when it is not one (an ``id`` is data, never trusted to be well formed)."""
    if raw is None:
        return None
    if len(raw) == UUID_TEXT_LEN:
        raw = raw.replace(b"-", b"")  # (4 dashes exactly, or the length check below fails)
    if len(raw) != 2 * ID_BYTES:
        return None
    try:
        return binascii.unhexlify(raw)
    except (binascii.Error, ValueError):
        return None


def canonical_id(raw: bytes | None) -> str:
    """The canonical text of the uuid an ``id`` header holds (lower-case ``8-4-4-4-12``),
    whatever form :func:`uuid_bytes` accepts; ``""`` when it holds none. An event's
    idempotency key is this text everywhere: read once, at reading."""
    id16 = uuid_bytes(raw)
    if id16 is None:
        return ""
    h = id16.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class RecordReader:
    """Reads consumed messages into :class:`Record` s; counts the ones it skips.

    ``skipped`` maps a :class:`Skip` reason to a count; callers add their own
    reasons through :meth:`skip` (a record that is not theirs) so one counter
    tells what a read passed by.
    """

    def __init__(self) -> None:
        self.skipped: Counter[Skip] = Counter()

    def skip(self, reason: Skip) -> None:
        self.skipped[reason] += 1

    def named(self, message: Any) -> dict[Any, Any] | None:
        """The headers of a consumed ``message`` (not an error event) by name, the last of
        duplicates winning, values unchecked (:meth:`Record.header` checks them); None when
        they cannot be read (counted). The only call of its ``headers()``: what a reader of
        ids alone (the audit) needs of a record, without a :class:`Record` per record."""
        try:
            raw = _HEADERS(message)  # not message.headers(): see _HEADERS
        except Exception:  # see _call_headers (the reason is only counted here)
            self.skipped[Skip.UNREADABLE_HEADERS] += 1
            return None
        if not raw:
            return {}
        try:
            return dict(raw)
        except (TypeError, ValueError):  # an item that is not a pair
            self.skipped[Skip.UNREADABLE_HEADERS] += 1
            return None

    def id_and_origin(self, message: Any) -> tuple[bytes, Any] | None:
        """The 16 bytes of a consumed ``message``'s ``id`` and its ``origin`` header's
        value (unchecked: None when absent); None when the headers cannot be read or
        the ``id`` is no uuid (counted). What a reader of ids alone needs (the audit)."""
        named = self.named(message)  # (the only call of headers())
        if named is None:
            return None
        raw = named.get(c.HEADER_ID)
        id16 = uuid_bytes(raw) if type(raw) is bytes else None
        if id16 is None:
            self.skipped[Skip.BAD_ID] += 1
            return None
        return id16, named.get(c.HEADER_ORIGIN)

    def read(self, message: Any) -> Record | None:
        """The record of a consumed ``message`` (not an error event), or None (counted)."""
        named = self.named(message)  # first: the only call of headers()
        if named is None:
            return None
        ts_type, ts_ms = message.timestamp()
        return Record(  # (confluent-kafka's types: str, int, int, int)
            message.topic(),
            message.partition(),
            message.offset(),
            None if ts_type == _KAFKA_TIMESTAMP_NOT_AVAILABLE else ts_ms,
            named,
        )

    def summary(self) -> str:
        """``reason=count, ...`` of the skipped records (empty when none)."""
        return ", ".join(f"{reason.value}={n}" for reason, n in sorted(self.skipped.items()))
