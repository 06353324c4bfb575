"""Exactly-once mode: a producer whose epoch moved on - a takeover, or the coordinator's timeout.

A collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`, the delivery mode
(:class:`EpochMoved`: it owns the question of who holds the slot). Kafka answers a
producer whose epoch moved on the same way whether another producer of its
``transactional.id`` took over (``init_transactions`` of a relay that took the slot)
or the transaction coordinator aborted its transaction at ``transaction.timeout.ms``
and bumped the epoch (the relay was paused past ``CDC_TX_TIMEOUT_MS``; librdkafka then
says "fenced by a newer instance"). Guarantees:

* :func:`is_takeover` (pure) tells them apart from evidence the relay owns: another
  session holds the slot, or who does cannot be read, or no transaction of ours
  can have outlived the timeout (our own session holds the slot: another producer
  took our id) - a takeover, reported as fenced (the relay exits 1, as before);
  otherwise the coordinator's timeout;
* a timeout is one WARNING naming ``CDC_TX_TIMEOUT_MS``, the transaction counted
  aborted, the producer let go and the session ended
  (:class:`TransactionTimedOutError`, retriable): the next one makes a new producer
  and reads again from the checkpoint - nothing lost, nothing published twice.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import psycopg
from confluent_kafka import KafkaError, KafkaException

from cdc.errors import KafkaUnavailableError
from cdc.pgconn import Use
from cdc.pgconn import connect as pg_connect
from cdc.relay.delivery.txbatch import TxBatch, TxState
from cdc.settings import Settings
from cdc.wal.stream import slot_holder

if TYPE_CHECKING:
    from cdc.relay.standby.wait import StandbyWait

log = logging.getLogger("cdc.relay")

_OPEN_STATES = (TxState.OPEN, TxState.COMMITTING, TxState.ABORTING)
#: Error codes that mean another producer took the transactional.id (or the
#: coordinator bumped the epoch: :func:`is_takeover` tells which).
FENCED_CODES = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)


def is_fenced(err: object) -> bool:
    """Whether a KafkaError (or a KafkaException carrying one) says this producer was fenced."""
    if isinstance(err, KafkaException):
        err = err.args[0] if err.args else None
    return isinstance(err, KafkaError) and err.code() in FENCED_CODES


def fatal_code(exc: KafkaException) -> int | None:
    """The code of the fatal error ``exc`` carries, else None."""
    err = exc.args[0] if exc.args else None
    if isinstance(err, KafkaError) and err.fatal():
        return int(err.code())
    return None


class TransactionTimedOutError(KafkaUnavailableError):
    """The transaction coordinator aborted the relay's transaction at its timeout (the
    producer's epoch moved on): nobody took over - a new producer, the session again."""


def is_takeover(*, slot_taken: bool | None, tx_age_ms: int | None, timeout_ms: int) -> bool:
    """Whether a producer whose epoch moved on (fenced, or an invalid epoch) was taken
    over by another relay, rather than aborted by the coordinator at the transaction
    timeout. Pure.

    ``slot_taken``: another session holds the slot (None: it could not be read);
    ``tx_age_ms``: how long the relay's Kafka transaction had been open (None: none
    was). A takeover when another session holds the slot, when that cannot be told,
    or when no transaction of ours could have outlived ``timeout_ms`` (so another
    producer took our transactional.id while our session still holds the slot); a
    timeout only when our session (or nobody) holds the slot and our transaction was
    open at least ``timeout_ms``: the coordinator's clock starts after ours."""
    if slot_taken is None or slot_taken:
        return True
    return tx_age_ms is None or tx_age_ms < timeout_ms


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


class EpochMoved:
    """The exactly-once mode's judgement of a moved epoch (see the module docstring): a
    collaborator of :class:`cdc.relay.delivery.exactly_once.ExactlyOnce`, which tells it
    the session's machine and acts on its answer (the abort counted, the producer let go)."""

    def __init__(self, settings: Settings, standby: StandbyWait) -> None:
        self._settings = settings
        #: the relay's standby wait: the walsender of its replication connection
        self._standby = standby

    def taken_over(self, batch: TxBatch) -> bool:
        """Whether the moved epoch is a takeover (:func:`is_takeover`), ``batch`` the
        session's transactions (how long the open one has been open)."""
        return is_takeover(
            slot_taken=self._slot_taken(),
            tx_age_ms=_tx_age_ms(batch),
            timeout_ms=self._settings.tx_timeout_ms,
        )

    def timed_out(self, batch: TxBatch, why: str | None) -> TransactionTimedOutError:
        """The coordinator aborted the transaction at its timeout: its one WARNING, and
        the error that ends the session (raised by the caller once it counted the abort
        and let the producer go: the next session reads from the checkpoint)."""
        age_ms = _tx_age_ms(batch)
        timeout_ms = self._settings.tx_timeout_ms
        log.warning(
            "Kafka transaction aborted by the transaction coordinator: open %.1fs, past"
            " CDC_TX_TIMEOUT_MS (%d ms) - the relay was paused, or a WAL transaction"
            " took that long (%s); nobody took over (this relay's session holds slot"
            " %s): a new producer, reading again from the checkpoint",
            (age_ms or 0) / 1000,
            timeout_ms,
            why,
            self._settings.slot,
        )
        return TransactionTimedOutError(
            f"Kafka transaction timed out (CDC_TX_TIMEOUT_MS={timeout_ms}): a new producer"
        )

    def _slot_taken(self) -> bool | None:
        """Whether another session holds the slot (None: it could not be read)."""
        settings = self._settings
        try:
            with pg_connect(settings.pg_dsn.get_secret_value(), Use.QUERY) as conn:
                holder = slot_holder(conn, settings.slot)
        except psycopg.Error as exc:
            log.warning("reading who holds slot %s: %s", settings.slot, exc)
            return None
        own = self._standby.own_walsender
        walsender = holder.walsender
        return walsender is not None and not (own is not None and walsender.same_as(own))


def _tx_age_ms(batch: TxBatch) -> int | None:
    """How long the session's Kafka transaction has been open (None: none is)."""
    if batch.state in _OPEN_STATES:
        return _now_ms() - batch.opened_ms
    return None
