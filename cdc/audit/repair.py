"""The audit's repair: republish the missing rows through the relay's own router.

Guarantees of :func:`republish`:

* each missing row becomes the record the relay would have produced - same topic,
  key, value bytes and headers (:func:`cdc.router.route_fields`: ``id``, ``type``,
  ``aggregatetype``, ``lsn``, ``commit_ts``, ``origin`` of this relay's session,
  ``traceparent``; timestamp = the row's commit time as the table knows it) -
  plus ``recovered: audit-<run id>``. ``lsn`` is the audit snapshot's WAL
  position (the row committed at or before it; its own commit LSN is not in the
  table), as the gap recovery writes its slot's consistent point;
* rows are published in commit order as far as the table knows it (commit time,
  else ``created_at``, then id): one aggregate's repaired events keep their order;
* a row the router refuses, or Kafka refuses for itself, is dead-lettered with
  the reason (the gap recovery's path, :mod:`cdc.relay.recovery`), never dropped;
* it returns only once Kafka acknowledged every record; any other Kafka error
  raises :class:`cdc.errors.KafkaUnavailableError` - a second run republishes
  again, which is harmless: consumers dedupe on ``id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cdc import constants as c
from cdc.audit import table as pg
from cdc.audit.ids import IdList
from cdc.lineage import origin_value
from cdc.relay import recovery
from cdc.relay.transactional import present_ids
from cdc.router import TxContext
from cdc.settings import Settings
from cdc.wal.replproto import lsn_to_str
from cdc.wal.slots import ServerIdentity


@dataclass(frozen=True)
class Republished:
    """What the repair published (dead letters included) and under which mark."""

    records: int
    mark: str


def republish(
    settings: Settings,
    ids: IdList,
    *,
    run_id: str,
    snapshot_lsn: int,
    identity: ServerIdentity,
) -> Republished:
    """Republish the rows of ``ids`` (see the module docstring)."""
    mark = f"audit-{run_id}"
    if not len(ids):
        return Republished(0, mark)
    origin_header = (c.HEADER_ORIGIN, origin_value(identity, settings.slot).encode())
    lsn = lsn_to_str(snapshot_lsn)
    producer, txs = recovery.publishing_producer(
        settings, system_id=identity.system_id, purpose="repair"
    )
    publisher = recovery._Publisher(
        settings, producer, recovery.topic_manager(settings), recovery._Acks(), tx=txs
    )
    try:
        with pg.connect(settings) as conn:
            rows = list(pg.repair_rows(conn, settings, ids))
        if txs is not None and rows:  # exactly-once: only ids read_committed lacks
            txs.present = present_ids(settings, min(recovery._epoch_us(r[6]) for r in rows) // 1000)
        tx: TxContext | None = None
        tx_ts: datetime | None = None
        for row in rows:
            if row[6] != tx_ts:  # rows of one transaction share its commit time
                tx_ts = row[6]
                tx = TxContext(lsn, recovery._epoch_us(row[6]), origin_header)
            assert tx is not None
            publisher.send(recovery._record(row, tx, settings, mark.encode()))
        publisher.wait_acked()
    finally:
        producer.flush(0)
    return Republished(publisher.sent, mark)
