"""The audit: the outbox table against Kafka against the consumer group, with repair.

Every health check of the pipeline compares points inside one lineage (the slot
against itself, the group against its topic). The audit compares the ends: the
outbox table - the truth, kept for ``CDC_RECOVERY_HORIZON_S`` - with what Kafka
holds and what the group has read, for a window of commit time. Whatever lost an
event between the table and the group (a slot advanced by hand, a slot re-made
by a tool, retention deleting records a lagging group never read, a bug), the
audit names the event, and the repair brings it back.

Stages of one run (:func:`run_audit`):

1. **table -> Kafka**: every outbox row of the window is in its routed topic (by
   the ``id`` header), or in the dead-letter topic, or still in the slot (in
   flight); else it is *missing*;
2. **Kafka -> table**: records of this relay's origin in the window whose id is in
   no row (*phantoms*, judged only while the table keeps rows), and ids found more
   than once (*duplicates*: at-least-once, reported, not an error);
3. **Kafka -> group**: per partition, the group's committed offset against the log
   start (records removed before the group processed them); the window's parked
   events by status.

Layout: a pure core (:mod:`cdc.audit.ids` compact id sets, :mod:`cdc.audit.compare`,
:mod:`cdc.audit.window`) and thin shells for PostgreSQL (:mod:`cdc.audit.table`),
Kafka (:mod:`cdc.audit.kafka`: records read by :class:`cdc.records.RecordReader`,
judged by :class:`cdc.evidence.Owner`), one run (:mod:`cdc.audit.run`) and the
relay's periodic audit (:mod:`cdc.relay.gaps.periodic_audit`). The repair is the project's one
re-publish path, :func:`cdc.repair.republish.republish` (``recovered: audit-<run>``).

The relay's start-up check (DESIGN, relay invariant 11) is a call of
:func:`verify_since` over the window since the last published record: the same
comparison, under the same per-slot audit lock, republishing with ``recovered: verify``.
Neither judges rows committed before the relay's first start when that chose not to
publish them (``slot init --from now``, an empty outbox): the slot history's first row.
"""

from cdc.audit.run import AuditReport, Verification, run_audit, verify_since
from cdc.audit.window import BeforeFirstStartError, Window, WindowError, window_for
from cdc.repair.lock import AuditBusyError

__all__ = [
    "AuditBusyError",
    "AuditReport",
    "BeforeFirstStartError",
    "Verification",
    "Window",
    "WindowError",
    "run_audit",
    "verify_since",
    "window_for",
]
