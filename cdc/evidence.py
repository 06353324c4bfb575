"""What counts as the relay's own evidence in Kafka: one named rule per decision, one reader.

Every decision that trusts records in Kafka reads them through
:class:`cdc.records.RecordReader` (a record whose headers cannot be read is skipped
and counted, never fatal) and judges them by the rule named here for it - never by
a check of its own:

=====================  ==============================  ===================================
decision               rule                            where it is asked
=====================  ==============================  ===================================
gap detection          :func:`gap_rule`: lineage       the tail read (:func:`cdc.lineage.
                       (system, a timeline of its      read_tails`) of the gap check, the
                       lineage, slot)                  checkpoint's own evidence, prune
recovery               :func:`recovery_rule`: lineage  the ids already in Kafka
                                                       (:func:`cdc.repair.transactional.
                                                       present_ids`) of a gap recovery
                                                       and a repair
audit                  :func:`audit_rule`: lineage;    the audit's read (:mod:`cdc.audit.
                       the server unknown: any         kafka`), the start-up check
                       origin vouches, nothing is a
                       candidate (the audit says it
                       cannot judge)
checkpoint             :func:`checkpoint_rule`: this   :func:`cdc.relay.delivery.
                       origin exactly (an ancestor's   checkpoint.judge`
                       checkpoint is judged under its
                       own origin, up to its fork)
dead letters           :func:`dead_letter_rule`: the   the audit's read, :func:`cdc.repair.
                       event id alone                  transactional.present_ids`
=====================  ==============================  ===================================

Why they differ: an outbox topic may hold records of other producers and of other
relays (another slot, another cluster, a timeline a failover abandoned), so a record
there counts only under the lineage rule; a checkpoint states how far *this session's
history* was published, so only the exact origin (or an ancestor's, up to the fork)
counts; a dead letter stands for the outbox row of its id (a uuid of that row) whoever
wrote it - dead letters from before they carried an ``origin`` (republished ones until
this version) have none, and a row dead-lettered is a row not lost.

Guarantees: a record is the relay's own under the lineage rule (:meth:`Owner.owns`)
only when its ``origin`` names this server's system identifier, a timeline of its
lineage (the current one or an ancestor: a promoted standby's records before the
promotion are on the parent timeline) and this slot; a record without ``origin``
(another producer, a relay from before the header), with one that does not parse,
or of another system, timeline branch or slot never counts. Every record the relay
publishes - dead letters included, republished ones too - carries ``origin`` =
``<system_identifier>/<timeline>/<slot>`` (:func:`origin_value`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from cdc import constants as c
from cdc.records import Record, RecordReader, Skip
from cdc.wal.slots import ServerIdentity


class Decision(Enum):
    """The decisions that trust records in Kafka (each has one rule: :data:`RULES`)."""

    GAP_DETECTION = "gap detection"  # the relay's newest own record (the tail read)
    RECOVERY = "recovery"  # which rows Kafka already holds (exactly-once repair)
    AUDIT = "audit"  # which rows of a window Kafka holds
    CHECKPOINT = "checkpoint"  # how far the relay's transactions were committed
    DEAD_LETTERS = "dead letters"  # a row dead-lettered is a row not lost


class Rule(Enum):
    """How a record is judged."""

    LINEAGE = "lineage"  # system, a timeline of the lineage, slot (Owner.owns)
    LINEAGE_OR_ANY = "lineage; any origin when the server is unknown"
    EXACT_ORIGIN = "the origin exactly"  # one session's history
    EVENT_ID = "the event id alone"  # whoever wrote it


#: decision -> its rule (the table of the module docstring, as data).
RULES: dict[Decision, Rule] = {
    Decision.GAP_DETECTION: Rule.LINEAGE,
    Decision.RECOVERY: Rule.LINEAGE,
    Decision.AUDIT: Rule.LINEAGE_OR_ANY,
    Decision.CHECKPOINT: Rule.EXACT_ORIGIN,
    Decision.DEAD_LETTERS: Rule.EVENT_ID,
}

#: Distinct ``origin`` values whose verdict an :class:`Owner` remembers (there are few:
#: one per relay session's system, timeline and slot), and the longest remembered.
MAX_ORIGINS = 1_024
MAX_ORIGIN_BYTES = 256


@dataclass(frozen=True)
class Origin:
    """The parsed ``origin`` header."""

    system_id: str
    timeline: int
    slot: str

    @classmethod
    def parse(cls, value: bytes | str) -> Origin | None:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = text.split("/", 2)
        if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2]:
            return None
        return cls(system_id=parts[0], timeline=int(parts[1]), slot=parts[2])

    def __str__(self) -> str:
        return f"{self.system_id}/{self.timeline}/{self.slot}"


def origin_value(identity: ServerIdentity, slot: str) -> str:
    """The ``origin`` header of the records a session on ``slot`` publishes."""
    return str(Origin(identity.system_id, identity.timeline, slot))


@dataclass(frozen=True)
class Owner:
    """Whose records count as the relay's own: its system, timeline lineage and slot.

    The one judgement of "is this record ours" (the tail read, the audit, the
    start-up check). Verdicts are remembered per ``origin`` value (a read meets few
    distinct ones): at most :data:`MAX_ORIGINS` values of at most
    :data:`MAX_ORIGIN_BYTES` bytes each."""

    system_id: str
    timelines: frozenset[int]
    slot: str
    _verdicts: dict[bytes, Origin | Skip] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    @classmethod
    def of(cls, server: ServerIdentity, slot: str) -> Owner:
        return cls(server.system_id, server.lineage, slot)

    def owns(self, origin: Origin) -> bool:
        return (
            origin.slot == self.slot
            and origin.system_id == self.system_id
            and origin.timeline in self.timelines
        )

    def verdict(self, raw: bytes | None) -> Origin | Skip:
        """The origin of a record whose ``origin`` header is ``raw`` when it is ours,
        else why not (:attr:`Skip.NO_ORIGIN`, :attr:`Skip.BAD_ORIGIN`,
        :attr:`Skip.FOREIGN_ORIGIN`)."""
        if not raw:
            return Skip.NO_ORIGIN
        known = self._verdicts.get(raw)
        if known is None:
            origin = Origin.parse(raw)
            if origin is None:
                known = Skip.BAD_ORIGIN
            else:
                known = origin if self.owns(origin) else Skip.FOREIGN_ORIGIN
            if len(self._verdicts) < MAX_ORIGINS and len(raw) <= MAX_ORIGIN_BYTES:
                self._verdicts[raw] = known
        return known

    def judge(self, record: Record, reader: RecordReader) -> Origin | None:
        """The record's origin when it is ours; else None, the reason counted in ``reader``."""
        raw = record.header(c.HEADER_ORIGIN)
        verdict = (raw and self._verdicts.get(raw)) or self.verdict(raw)  # (the memo first)
        if isinstance(verdict, Skip):
            reader.skip(verdict)
            return None
        return verdict


def gap_rule(server: ServerIdentity, slot: str) -> Owner:
    """Gap detection: a record of an outbox topic is the relay's own under the lineage."""
    return Owner.of(server, slot)


def recovery_rule(server: ServerIdentity, slot: str) -> Owner:
    """Recovery: an id is in Kafka when a record of the relay's lineage carries it."""
    return Owner.of(server, slot)


def audit_rule(server: ServerIdentity | None, slot: str) -> Owner | None:
    """The audit: the lineage rule; None when the server is unknown (any origin vouches
    for its id, and no row is a candidate: the audit says it cannot judge)."""
    return Owner.of(server, slot) if server is not None else None


def checkpoint_rule(header: bytes | None, origin: str) -> str | None:
    """A checkpoint record counts only when its ``origin`` header is ``origin`` exactly:
    None when it does, else why not (for the log line)."""
    if header == origin.encode():
        return None
    said = "no origin header" if header is None else "another origin header"
    return f"{said} (not written by this relay)"


def dead_letter_rule(record_id: bytes | None) -> bool:
    """A dead letter vouches for the event of its id, whoever wrote it (see the table)."""
    return record_id is not None
