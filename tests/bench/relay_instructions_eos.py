"""The exactly-once relay's replay for :mod:`tests.bench.relay_instructions` (``--delivery
exactly-once``): the same synthetic stream through :class:`ExactlyOnceRelay`'s loop.

What is real: the transactional producer against the local broker (its
``init_transactions``), the session's start (the mode's ``session_begins``:
the checkpoint topic made, the checkpoint read with ``read_committed``, the machine
:class:`~cdc.relay.delivery.txbatch.TxBatch` set up), the machine's decisions, the commit on
its own thread (:mod:`cdc.relay.delivery.overlap`) with records read meanwhile buffered and
released into the next transaction, and each part's end committed as a shutdown
does (the commit under way awaited, then ``flush``). What is replaced, as for
at-least-once: the replication connection and the slot ledger's writes, and the one
query of the server's WAL position a start makes (the bound a checkpoint is judged
against: the replay's own stream lies below it).

Every run has a new ``origin`` (so a new checkpoint key), ``transactional.id`` and
checkpoint topic, all of the same length: no run reads another's checkpoint. A
Kafka transaction is committed at ``CDC_TX_MAX_RECORDS`` (the default, 5,000: what
ends one while a backlog drains) and never by age (``CDC_TX_MAX_MS`` far beyond a
run, so how many commits a run makes does not depend on the broker's or valgrind's
timing): a part's last transaction is committed by its end's flush. How many
records are read while a commit is under way (buffered) still depends on the
broker's timing, as it does in a real relay.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

#: CDC_TX_MAX_MS and CDC_TX_TIMEOUT_MS of the replay: no commit or abort by age within
#: a run under callgrind (the broker's transaction.max.timeout.ms is 15 minutes).
TX_MAX_MS = 600_000
TX_TIMEOUT_MS = 900_000


def replay_relay_eos(settings: Any, ledger_of: Any) -> Any:
    """An :class:`~cdc.relay.delivery.exactly_once.ExactlyOnceRelay` whose slot ledger is
    ``ledger_of(settings)`` (:func:`tests.bench.relay_instructions.replay_relay`'s)."""
    from cdc.relay.delivery.exactly_once import ExactlyOnceRelay

    class ReplayRelay(ExactlyOnceRelay):
        def _new_ledger(self) -> Any:
            return ledger_of(self.settings)

        def _init_guard(self) -> None:  # (an older checkout's)
            self._ledger = ledger_of(self.settings)

    return ReplayRelay(settings, serve_http=False)


def settings_eos(**kwargs: Any) -> Any:
    """The replay's settings in exactly-once mode (names of this run only)."""
    from cdc.settings import Settings

    run = uuid.uuid4().hex[:12]
    return Settings(
        **kwargs,
        delivery="exactly-once",
        transactional_id=f"outbox-cdc.ir.{run}",
        checkpoint_topic=f"__outbox_cdc_checkpoints.ir{run}",
        tx_max_ms=TX_MAX_MS,
        tx_timeout_ms=TX_TIMEOUT_MS,
    )


def origin_eos() -> tuple[str, bytes]:
    """A new origin every run (its checkpoint key), always of the same length."""
    return ("origin", b"7412345678901234567/1/ir%s" % uuid.uuid4().hex[:12].encode())


def start_eos(relay: Any, bootstrap: str, origin: tuple[str, bytes]) -> Any:
    """The transactional producer of the session, and the WAL position query replaced
    (a replay has no server: every LSN of its stream lies below the bound)."""
    from cdc.relay.delivery import checkpoint, eos_start
    from cdc.wal.slots import ServerIdentity

    checkpoint.server_wal_position = lambda settings: 0xFFFF_FFFF_0000_0000
    # (the session's start asks the server for its timeline history: timeline 1 has none)
    system_id = origin[1].split(b"/", 1)[0].decode()
    eos_start.identify_system = lambda dsn: ServerIdentity(system_id, 1)  # type: ignore[assignment]
    mode = getattr(relay, "mode", relay)  # (an older checkout: the relay itself)
    return (mode.new_producer if mode is not relay else relay._new_producer)(origin)


def end_part_eos(relay: Any, sess: Any, end_lsn: int) -> None:
    """A part's end as a shutdown commits it: the commit under way awaited, the open
    transaction flushed (committed), its outcome awaited; then its checkpoint must
    be the stream's last commit end-LSN."""
    from cdc.relay.delivery.txbatch import TxState

    eos = getattr(relay, "mode", relay)  # (the delivery mode; an older checkout: the relay)
    # (the commit's collaborator; an older checkout: the mode's own step, a mixin's)
    overlap = getattr(eos, "_overlap", None)
    await_commit = overlap.await_commit if overlap is not None else eos._await_commit
    await_commit(sess)
    (eos.drain_dead_letters if eos is not relay else relay._drain_dlq)(sess)
    eos._act(sess, eos._batch.flush(int(time.monotonic() * 1000), waiting=False))
    await_commit(sess)
    # (records released into the last transaction: acknowledged once let go, as the
    # loop's next turn or the shutdown would)
    sess.reports = None
    batch = eos._batch
    if batch.state is not TxState.IDLE or batch.committed != end_lsn:
        sys.exit(
            f"replay's transactions not committed: {batch.state.value}, checkpoint"
            f" {batch.committed:#x}, not {end_lsn:#x}"
        )
