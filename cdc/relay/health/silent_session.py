"""The relay's judgement of a silent replication connection (a collaborator of the relay).

A session silent for CDC_REPLICATION_SILENCE_S is looked at over an ordinary connection:
a walsender that works (decoding a large transaction, replaying, writing) is left alone and
said so at most once per interval; the session is ended - and its walsender with it, which
a half-open path keeps holding the slot - only when the path to it is dead, after one last
reply request (:data:`~cdc.relay.health.silence.LAST_CHANCE_S`). The decisions are the pure
:class:`~cdc.relay.health.silence.SilenceWatch`'s; this is its shell.
"""

from __future__ import annotations

import logging
import time

import psycopg

from cdc.errors import StreamError
from cdc.relay.health.metrics import RelayMetrics
from cdc.relay.health.silence import (
    LAST_CHANCE_S,
    LOOK_TIMEOUT_S,
    Silence,
    SilenceWatch,
    silence_bound_s,
)
from cdc.relay.health.state import Session
from cdc.settings import Settings
from cdc.wal.looks import end_walsender, look_at_walsender

log = logging.getLogger("cdc.relay")


#: Quiet this long, the relay's status update asks the server for a reply, so a
#: live server is never silent for CDC_REPLICATION_SILENCE_S (its own keepalives
#: come only after wal_sender_timeout/2 without a reply from the relay, and the
#: relay's status updates reset that clock: without asking, an idle live server
#: could be silent indefinitely).
REPLY_REQUEST_AFTER_S = 5.0


class SilentSession:
    """The silence detector's shell (a collaborator of :class:`~cdc.relay.stream.loop.Relay`)."""

    def __init__(self, settings: Settings, metrics: RelayMetrics) -> None:
        self.settings = settings
        self.metrics = metrics

    @staticmethod
    def asking(silence: SilenceWatch, silent_s: float) -> bool:
        """Whether this status update asks the server for a reply (noted by the watch)."""
        ask = silent_s >= silence.ask_after_s(REPLY_REQUEST_AFTER_S)
        if ask:
            silence.asking(time.time_ns() // 1000)
        return ask

    def watch(self, sess: Session) -> SilenceWatch:
        """The session's silence detector: it looks after CDC_REPLICATION_SILENCE_S; a
        walsender no look can see is ended after the relay's own bound (that plus the
        look's timeout), whatever the server's wal_sender_timeout."""
        configured_s = self.settings.replication_silence_s
        return SilenceWatch(look_after_s=configured_s, bound_s=silence_bound_s(configured_s))

    def judge(self, sess: Session, watch: SilenceWatch, silent_s: float) -> None:
        """Look at the silent session's walsender over an ordinary connection; leave a
        working one alone (and say so, at most once per interval); end the session (and
        its walsender) only when the path to it is dead: raises StreamError then."""
        stream = sess.stream
        dsn = stream.server_dsn(self.settings.pg_dsn.get_secret_value())
        pid = stream.backend_pid
        look, unseen = None, ""
        started = time.monotonic()
        try:
            look = look_at_walsender(dsn, self.settings.slot, pid, LOOK_TIMEOUT_S)
        except psycopg.Error as exc:
            unseen = _first_line(exc)
        now = time.monotonic()
        silent_s += now - started  # (a failed look takes up to LOOK_TIMEOUT_S)
        verdict = watch.judge(silent_s, now, look, unseen)
        if verdict.action is Silence.END and self._answers_at_last(sess):
            watch.heard()  # (the next turn reads what came)
            return
        self.metrics.walsender_looks.labels(verdict.action.value).inc()
        if verdict.action is Silence.END:
            self._end_silent(dsn, pid, silent_s, verdict.reason)
            raise StreamError(
                f"replication connection silent for {silent_s:.0f}s (no message, keepalives"
                f" included, though the relay asked for one) and its walsender {pid}"
                f" {verdict.reason}: reopening it (CDC_REPLICATION_SILENCE_S)"
            )
        if verdict.log:
            log.info(
                "replication connection silent for %.0fs, but its walsender %d %s:"
                " leaving it alone",
                silent_s,
                pid,
                verdict.reason,
            )

    def _answers_at_last(self, sess: Session) -> bool:
        """One last reply request before a session is ended: True when something
        arrives within LAST_CHANCE_S (a walsender just out of a long replay)."""
        sess.stream.send_status(sess.tracker.confirmable, reply_requested=True, ask_raise=False)
        return sess.stream.wait_readable(LAST_CHANCE_S)

    def _end_silent(self, dsn: str, pid: int, silent_s: float, why: str) -> None:
        """Count and log a dead replication connection; end its walsender (which a
        half-open path keeps holding the slot), so the next session can start."""
        self.metrics.replication_silences.inc()
        ended = end_walsender(dsn, self.settings.slot, pid, LOOK_TIMEOUT_S)
        log.warning(
            "replication connection silent for %.0fs (CDC_REPLICATION_SILENCE_S=%.0f) and"
            " its walsender %d %s: closing it%s",
            silent_s,
            self.settings.replication_silence_s,
            pid,
            why,
            f"; its walsender {pid} ended" if ended else "",
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
