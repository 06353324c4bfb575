"""What ``outbox-cdc prune`` must keep so that a slot gap can always be recovered from the table.

Guarantees (:func:`retention_for`):

* rows younger than ``CDC_RECOVERY_HORIZON_S`` are kept, whatever ``--older-than`` says;
* while the slot lives, rows the slot may not have confirmed are kept: their
  inserting transaction is not older than the slot's ``catalog_xmin`` (every
  transaction older than it ended before the slot's restart point, so a
  committed one is in Kafka); this uses transaction ids, not ``created_at``,
  so a long transaction's row is kept however old its ``created_at``;
* while a gap is open, rows from its window's start are kept; a gap whose
  window starts at the first row refuses the prune;
* with the slot missing or lost and no open gap (the relay has not looked yet),
  rows from the relay's last record in Kafka minus ``CDC_GAP_MARGIN_S`` are
  kept - only records whose ``origin`` names this server's system, timeline
  lineage and the slot count (:mod:`cdc.lineage`, read defensively); when Kafka
  is not configured or holds no record of the relay's, the prune is refused
  (:class:`PruneRefusedError`): nothing says what was published.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from confluent_kafka import KafkaException

from cdc import gaps
from cdc.errors import CdcError
from cdc.evidence import gap_rule
from cdc.lineage import list_topics, read_tails, relay_topics
from cdc.outbox import Retention
from cdc.settings import Settings
from cdc.wal.slots import identify_system, read_slot

Conn = psycopg.Connection[Any]


class PruneRefusedError(CdcError):
    """Pruning now could delete a row a gap recovery needs."""


def retention_for(conn: Conn, settings: Settings) -> Retention:
    """The :class:`Retention` of ``settings.slot`` now (see the module docstring)."""
    horizon = settings.recovery_horizon_s
    opened = gaps.open_gaps(conn, settings.slot)
    if opened:
        starts = [g.window_start for g in opened]
        if any(start is None for start in starts):
            raise PruneRefusedError(
                f"gap {opened[0].id} of slot {settings.slot} is open with a window from the"
                " first outbox row: nothing pruned until it is recovered or accepted"
            )
        return Retention(horizon_s=horizon, keep_since=min(s for s in starts if s is not None))
    slot = read_slot(conn, settings.slot)
    if slot is not None and slot.wal_status != "lost":
        return Retention(horizon_s=horizon, slot=settings.slot)
    state = "missing" if slot is None else "lost"
    if not settings.kafka_bootstrap_servers:
        raise PruneRefusedError(
            f"slot {settings.slot} is {state} and KAFKA_BOOTSTRAP_SERVERS is not set: nothing"
            " says which rows were published, nothing pruned"
        )
    try:
        server = identify_system(settings.pg_dsn.get_secret_value())
        topics, _ = relay_topics(conn, settings, list_topics(settings))
        last = read_tails(settings, gap_rule(server, settings.slot), topics).last
    except (KafkaException, CdcError) as exc:
        raise PruneRefusedError(f"slot {settings.slot} is {state} and: {exc}") from exc
    if last is None:
        raise PruneRefusedError(
            f"slot {settings.slot} is {state} and Kafka holds no record of it: nothing pruned"
        )
    return Retention(
        horizon_s=horizon, keep_since=last.commit_ts - timedelta(seconds=settings.gap_margin_s)
    )
