"""Exactly-once mode's session start: which checkpoint counts, and how far.

A collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`. Run once per
session, after ``init_transactions`` fenced the relay before (its checkpoints then all
lie at or below the server's WAL position). Guarantees (the reads and the rules are
:mod:`cdc.relay.delivery.checkpoint`'s):

* the checkpoint is read from the relay's own checkpoint topic, never waiting for a
  transaction (the shared topic of before once, at an upgrade), judged before it is
  trusted, and - on a new timeline without one of its own - inherited from the
  nearest ancestor timeline up to its fork;
* it counts only as far as the relay's own committed records show it
  (:func:`cdc.relay.delivery.checkpoint.provable`: the session's tail read of its topics -
  kept by the slot guard, :attr:`cdc.relay.gaps.guard.SlotGuard.last_record` - its dead
  letters, the outbox table);
* whatever was found is said once, in the log: not trusted (warned once per
  reason and process), held back by another producer's transaction, inherited,
  read from the shared topic, or counted short of its value.
"""

from __future__ import annotations

import logging

from cdc.evidence import Origin, gap_rule
from cdc.lineage import LastRecord
from cdc.relay.delivery import checkpoint as ckpt
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.slots import ServerIdentity, identify_system

log = logging.getLogger("cdc.relay")


class EosStart:
    """The exactly-once mode's checkpoint at a session's start (see the module docstring;
    a collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._origin = ""
        self._last_record: LastRecord | None = None
        #: why a checkpoint was not trusted (each warned about once)
        self._distrusted: set[str] = set()

    def checkpoint(self, start: int, origin: str, last_record: LastRecord | None) -> int | None:
        """The checkpoint this session skips below (None: none counts); ``start``: the
        slot's confirmed position, ``origin`` the session's, ``last_record`` the relay's
        newest own record the session's tail read found (the slot guard's: the evidence)."""
        self._origin = origin
        self._last_record = last_record
        topic = ckpt.ensure_checkpoint_topic(self.settings)
        # (after init_transactions: the relay before is fenced, its checkpoints are all
        # at or below the WAL position now)
        wal_bound = ckpt.server_wal_position(self.settings)
        server = identify_system(self.settings.pg_dsn.get_secret_value())
        read = ckpt.read_checkpoint(
            self.settings,
            topic,
            self._origin,
            wal_bound=wal_bound,
            ancestors=self._ancestors(server),
        )
        found = read.lsn
        if found is not None:  # (only as far as the relay's own records show it)
            evidence = ckpt.own_evidence(
                self.settings, gap_rule(server, self.settings.slot), self._last_record
            )
            proven = ckpt.provable(
                found, confirmed=start, streamed=evidence.streamed, rows=evidence.rows
            )
            if proven < found:
                log.info(
                    "checkpoint %s of %s counts up to %s: the relay's own records in Kafka"
                    " reach %s (lsn), the slot is confirmed at %s; WAL transactions beyond are"
                    " read again (any already in Kafka may be published again; none is lost)",
                    lsn_to_str(found),
                    self._origin,
                    lsn_to_str(proven),
                    lsn_to_str(evidence.streamed),
                    lsn_to_str(start),
                    extra={"lsn": lsn_to_str(proven)},
                )
            found = proven
        if read.hidden:
            log.warning(
                "checkpoint topic %s: %d records lie past its last stable offset (another"
                " producer's transaction is open there: only this relay's principal should"
                " write to it); read past it uncommitted, the checkpoint counts only as far"
                " as the relay's own committed records show it",
                topic,
                read.hidden,
                extra={"topic": topic},
            )
        if read.inherited and read.lsn is not None:
            log.info(
                "no checkpoint of %s yet (a new timeline): the checkpoint %s of %s counts up"
                " to where that timeline ended (%s, the same WAL before it): %s",
                self._origin,
                lsn_to_str(read.inherited_lsn),
                read.inherited,
                lsn_to_str(read.fork),
                lsn_to_str(read.lsn),
                extra={"lsn": lsn_to_str(read.lsn)},
            )
        if read.topic != topic:
            log.info(
                "no checkpoint of %s in %s yet: read from %s, the topic relays shared"
                " before (once: this relay's checkpoints go to %s)",
                self._origin,
                topic,
                read.topic,
                topic,
                extra={"topic": read.topic},
            )
        if read.distrusted and read.distrusted not in self._distrusted:
            self._distrusted.add(read.distrusted)  # (once per reason and process)
            log.warning(
                "checkpoint of %s in %s (%s) not trusted: %s; starting from the slot's"
                " confirmed position %s instead (WAL transactions since then may be"
                " published again; none is lost)",
                self._origin,
                read.topic,
                read.where,
                read.distrusted,
                lsn_to_str(start),
                extra={"topic": read.topic},
            )
        return found

    def _ancestors(self, server: ServerIdentity) -> list[tuple[str, int]]:
        """The origins of this session's earlier timelines (the server's timeline
        history), nearest first, each with the LSN where that timeline ended."""
        current = Origin.parse(self._origin)
        if current is None or current.timeline <= 1:
            return []
        return [
            (str(Origin(current.system_id, timeline, current.slot)), end)
            for timeline, end in reversed(server.ancestors)
        ]
