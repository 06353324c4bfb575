"""The relay: committed outbox inserts from the WAL (pgoutput) into Kafka.

What it is for: the ``outbox-cdc relay`` process, in five folders by role, each
importing only the ones below it (top first):

- :mod:`.delivery` - what exactly-once adds: Kafka transactions, the pure transaction
  machine (:mod:`.delivery.txbatch`), the checkpoint;
- :mod:`.stream` - the loop (:class:`~cdc.relay.stream.loop.Relay`: sessions,
  back-pressure, shutdown, its collaborators held) and one record's path: changes to
  records, the producer, dead letters; the delivery mode's points
  (:mod:`.stream.mode`);
- :mod:`.gaps` - whether the slot may stream (:mod:`.gaps.gap`, pure), the gap check
  before each session (:mod:`.gaps.guard`), the start-up check
  (:mod:`.gaps.start_check`), closing a gap
  (:mod:`.gaps.recovery`, also ``outbox-cdc slot recover``), the confirm limit
  (:mod:`.gaps.ledger`);
- :mod:`.standby` - the standby's wait, standby-safe mode (decisions pure in
  :mod:`.standby.gate`);
- :mod:`.health` - state, metrics, the silence and stall watches, Kafka readiness.

What it may import: the ``cdc`` kernel (settings, errors, constants, Kafka, LSN
tracking, the WAL protocol and decoder, the router), :mod:`cdc.audit` and
:mod:`cdc.repair`; never :mod:`sinks` and never the command line; nothing of the
relay is imported by the audit. Invariants: the slot's confirmed LSN advances only
past transactions all of whose records Kafka acknowledged (or dead-lettered and
acknowledged); the stream never stalls on one row and never drops one; no error
path ends the process; a slot is created only at a first start, never to paper over
a gap.
"""
