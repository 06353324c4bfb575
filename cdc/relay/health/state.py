"""The relay's state: its states, one streaming session, the poison ids, a pending dead letter.

Guarantees: state stays bounded. :class:`PoisonIds` is an LRU of at most
:data:`POISON_MAX` ids; a :class:`Session` lives as long as one replication
connection and holds its LSN bookkeeping (:class:`cdc.wal.lsn.LsnTracker`), its
relation cache and the dead letters not yet handed to Kafka, oldest first.

States and transitions::

    STARTING --slot held elsewhere--> STANDBY --slot free--> STREAMING
    STREAMING <--in-flight at bound / below--> BACKPRESSURE
    STREAMING | BACKPRESSURE --a dead letter fails--> HELD --a dead letter written--> STREAMING
    STREAMING | BACKPRESSURE --no ack for CDC_RELAY_STALL_AFTER_S--> STALLED --an ack--> back
    (HELD stays HELD, its cause named; outbox_relay_stalled is 1 in both)
    STREAMING | BACKPRESSURE --Kafka unreachable while work waits--> STALLED at once
        (``kafka unreachable: <why>``; back at the first ack or a broker up again;
        outbox_relay_stalled still only after CDC_RELAY_STALL_AFTER_S)
    STREAMING --silent past CDC_REPLICATION_SILENCE_S, its walsender cannot be seen-->
        STALLED (``replication connection silent for ... cannot be seen (...)``)
        --a message, or a look that sees it--> STREAMING | the session ended
    STANDBY --slot still held--> STANDBY (no pass through STARTING between looks)
    STARTING | STREAMING | BACKPRESSURE | HELD --stream or Kafka error--> RECONNECTING
        --> (its cause kept) STREAMING | STANDBY | another error
    STANDBY | STREAMING | BACKPRESSURE | HELD --producer fatal error--> REBUILDING --> STARTING
    STARTING --slot lost/dropped/failed over--> GAP --recovered or loss accepted--> STARTING
    any --SIGTERM--> STOPPING --> STOPPED

Ready (``/readyz`` 200) in STREAMING and BACKPRESSURE only; otherwise the body
names the state and its cause.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from cdc.backoff import Backoff
from cdc.router import (
    BrokenOutbox,
    DeadLetterCode,
    OutboxLayout,
    TxContext,
)
from cdc.wal import pgoutput as pgo
from cdc.wal.lsn import LsnTracker
from cdc.wal.stream import (
    ReplicationStream,
)

#: Retries of a dead letter that could not be written (reset once one is written).
DLQ_RETRY_MIN_S = 0.5


DLQ_RETRY_MAX_S = 30.0


#: Event ids remembered as refused by Kafka (see PoisonIds): ~100 bytes each.
POISON_MAX = 10_000


class RelayState(enum.Enum):
    STARTING = "starting"  # connecting, ensuring slot and publication
    STANDBY = "standby"  # another relay streams the slot; we wait to take over
    STREAMING = "streaming"  # reading WAL and producing
    BACKPRESSURE = "backpressure"  # in-flight at its bound: not reading WAL
    HELD = "held"  # a dead letter could not be written: not reading WAL, retrying it
    GAP = "gap"  # slot lost/dropped/failed over: recovering, or waiting for an operator
    STALLED = "stalled"  # work waits and nothing was acknowledged for CDC_RELAY_STALL_AFTER_S
    RECONNECTING = "reconnecting"  # after an error, waiting before a new session
    REBUILDING = "rebuilding"  # producer fatal error: purged, closed; a new one after a back-off
    STOPPING = "stopping"  # SIGTERM received: flushing and confirming
    STOPPED = "stopped"  # done; the process exits 0


class PoisonIds(OrderedDict[bytes, tuple[DeadLetterCode, str, bool]]):
    """Event ids Kafka refused -> (code, reason, alone); least recently used first.

    Purpose: a record the broker refuses is dead-lettered, but its transaction is
    confirmed only once the dead letter is acknowledged; after a reconnect or a
    producer rebuild the same event is read again. Found here, it goes straight to
    the dead-letter topic instead of being offered to Kafka again (a second refusal -
    and, with ``enable.gapless.guarantee``, a second fatal error).

    Kafka judges a batch, not a record: a topic's ``max.message.bytes`` is checked
    against the whole batch, and librdkafka fails every record of a refused batch.
    So a refusal of a record that shared its batch names a **suspect**
    (:meth:`suspect`, ``alone`` False): read again, it is produced alone - nothing
    else in flight, nothing produced after it before its report - and only a
    refusal of the record alone (:meth:`remember`, ``alone`` True) makes its
    dead letter. Innocent batch-mates reach their topic.

    Bounded: at most ``max_entries`` ids (the relay's: :data:`POISON_MAX` plus
    ``CDC_MAX_IN_FLIGHT`` - every record one session can have in flight, so its refused
    batches never push out its own suspects), the least recently used forgotten
    first. Forgetting loses nothing: an event read again after its id was
    forgotten is offered to Kafka again and judged by the same path. A session ended
    by a refused batch is followed at once by the next (no back-off: progress - the
    first record it has not confirmed is a suspect still remembered, judged alone).
    """

    def __init__(self, max_entries: int = POISON_MAX) -> None:
        super().__init__()
        self.max_entries = max_entries

    def remember(self, event_id: bytes, code: DeadLetterCode, reason: str) -> None:
        """Kafka refused ``event_id`` produced alone, for ``reason``: its dead letter is
        due; forget the oldest beyond the bound."""
        self._put(event_id, (code, reason, True))

    def suspect(self, event_id: bytes, code: DeadLetterCode, reason: str) -> None:
        """Kafka refused the batch ``event_id`` was in: produce it alone when it is read
        again (a refusal remembered already stays as it is)."""
        known = self.get(event_id)
        self._put(event_id, known if known is not None and known[2] else (code, reason, False))

    def _put(self, event_id: bytes, entry: tuple[DeadLetterCode, str, bool]) -> None:
        self[event_id] = entry
        self.move_to_end(event_id)
        while len(self) > self.max_entries:
            self.popitem(last=False)

    def recall(self, event_id: bytes) -> tuple[DeadLetterCode, str, bool] | None:
        """The refusal of ``event_id`` if remembered (it becomes the most recent):
        ``(code, reason, alone)``."""
        found = self.get(event_id)
        if found is not None:
            self.move_to_end(event_id)
        return found


@dataclass(eq=False)
class _PendingDlq:
    """A dead letter waiting to be written; it holds one add of ``tx_id`` in the tracker."""

    tx_id: int
    code: DeadLetterCode
    reason: str
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int
    event_id: str
    #: Kafka refused the full dead letter for its size: write the minimal form.
    minimal: bool = False


@dataclass
class Session:
    """One streaming session: the stream, its LSN bookkeeping and relation cache."""

    stream: ReplicationStream
    tracker: LsnTracker
    relations: pgo.RelationCache = field(default_factory=pgo.RelationCache)
    tx_id: int | None = None
    #: the open transaction's Begin: (final_lsn, commit time in Unix us, the texts of
    #: its lsn and commit_ts headers), read in place (cdc.wal.pgoutput.begin_context)
    begin: tuple[int, int, bytes, bytes] | None = None
    #: the open transaction's context, built at its first record (None before it:
    #: a transaction without outbox records costs none)
    tx: TxContext | None = None
    reply_requested: bool = False
    fatal: KafkaError | None = None
    #: dead letters not yet handed to Kafka, oldest first
    pending_dlq: deque[_PendingDlq] = field(default_factory=deque)
    #: why a dead letter failed (the stream is HELD), None while they flow
    held: str | None = None
    #: no dead letter is produced before this time (monotonic seconds)
    dlq_retry_at: float = 0.0
    dlq_backoff: Backoff = field(
        default_factory=lambda: Backoff(min_s=DLQ_RETRY_MIN_S, max_s=DLQ_RETRY_MAX_S)
    )
    last_confirmed: int = 0
    ignored_kinds: set[str] = field(default_factory=set)
    #: relation oid -> positions of the routed columns (found by name), or why the
    #: outbox relation is unusable, None if not the outbox (cleared by a Relation)
    outbox_oids: dict[int, OutboxLayout | BrokenOutbox | None] = field(default_factory=dict)
    #: the ``origin`` header of this session's records (cdc.lineage), built once
    origin: tuple[str, bytes] | None = None
    #: acknowledged records per topic since the last status (metrics are
    #: updated in bulk: a Prometheus inc per record was a tenth of the CPU)
    acked: dict[str, int] = field(default_factory=dict)
    #: the delivery reports of the records being added (cdc.relay.stream.producing.Reports);
    #: let go at Commit and after each read batch, so they can be acknowledged
    reports: Any = None
    #: an error raised where it could only be printed (a Reports' finalizer): the
    #: stream loop raises it, as poll() raised a delivery callback's error before
    fault: Exception | None = None
    #: the last read turn ended because no more WAL was there to read (False: it read
    #: its READ_BATCH messages with more already there, or stopped at the in-flight
    #: bound - a backlog; exactly-once then makes larger Kafka transactions)
    caught_up: bool = True


#: Headers of a record as the producer takes them.
Headers = list[tuple[str, bytes]]
#: The record-handling steps the relay's parts call on each other take a record's
#: parts positionally (keyword parsing is measurable on the hot path):
#: ``_send(sess, tx_id, topic, value, key, headers, timestamp_ms, event_id)``,
SendStep = Callable[[Session, int, str, bytes, bytes, Headers, int, bytes], None]
#: ``_refused(sess, tx_id, exc, topic, key, value, headers, timestamp_ms)``,
RefusedStep = Callable[[Session, int, KafkaException, str, bytes, bytes, Headers, int], None]
#: ``_queue_dlq(sess, tx_id, code, reason, topic, key, value, headers, timestamp_ms)``.
QueueStep = Callable[[Session, int, DeadLetterCode, str, str, bytes, bytes, Headers, int], None]
