"""The silence detector's decision: is a quiet replication connection dead, or its walsender busy?

A walsender decoding a large transaction sends nothing to the relay - not even
a keepalive - for as long as one step of its work lasts: spilling the
transaction to disk while it reads its WAL, replaying it at its commit
(``wal_sender_timeout`` 0 or raised: a keepalive only after half of it). Silence
alone is no evidence of a dead path; ending such a session restarts the
decoding from the slot's ``restart_lsn``, to be ended again: a livelock. So the
relay *looks* at its walsender over an ordinary connection before it ends
anything, and judges what it sees by how a walsender works: between two WAL
records it reads the relay's messages (``pg_stat_replication.reply_time``
shows the last one read) and queues the answer to a reply request, which it
sends when that record's step is done; inside a step it reads nothing.

Guarantees (pure; :mod:`cdc.relay.stream.loop` listens, asks, looks and acts):

* nothing is looked at before ``CDC_REPLICATION_SILENCE_S`` of silence; then at
  most every :data:`LOOK_EVERY_S`; the relay asks for a reply from the first
  look on (at the latest);
* a working walsender is left alone (:attr:`Silence.LEAVE`), however long the
  silence: one on the CPU (no wait event) or waiting for anything but its
  client (spilling, reading WAL or spill files, a lock), unless it had read a
  reply request of this silence and went on since (below);
* a session is ended (:attr:`Silence.END`) only on evidence that the path to
  its walsender is dead: the walsender is gone; it had read a reply request of
  this silence at the last look and finished a WAL record since (``sent_lsn``
  moved: its answer was sent, and never arrived); it waits for its client -
  idle waiting for WAL (it has read and answered every request that reached
  it), or blocked writing to the relay (``WalSenderWriteData``) - the same way
  at two looks at least :data:`LOOK_EVERY_S` apart (the relay asked for a reply
  meanwhile; ``sent_lsn`` may have moved: it reads WAL into the void); or no look
  has seen it for the relay's own bound (:func:`silence_bound_s`:
  ``CDC_REPLICATION_SILENCE_S`` plus the look's timeout :data:`LOOK_TIMEOUT_S`,
  counted from the silence's start or the last look that saw it), whatever the
  server's ``wal_sender_timeout`` (0 included): a look goes to the same server, so
  a walsender that cannot be looked at is most often behind the same dead path,
  and one the relay cannot reach is not livelocked by ending the relay's side (its
  orphan is taken back at the next session, :mod:`cdc.relay.standby.wait`). The
  loop gives it one last chance (a reply request, :data:`LAST_CHANCE_S`) before it
  ends the session;
* while the last look of a silence failed, :attr:`SilenceWatch.blind` names the
  silence and the failed look (``/readyz`` answers 503 with it): the relay cannot
  tell a working walsender from a dead path, and says so;
* :class:`SilenceWatch` reports a walsender left alone at most once per
  ``CDC_REPLICATION_SILENCE_S`` (``log`` in its answer).

Transitions of one silence (any message heard goes back to LISTENING)::

    LISTENING ──silent > CDC_REPLICATION_SILENCE_S──► LOOKING (asking for a reply)
    LOOKING ──working──► LOOKING (left alone, said once per interval)
    LOOKING ──first look: it waits for its client──► LOOKING
    LOOKING ──cannot be seen──► LOOKING, blind (503)
    LOOKING ──gone / read our request and went on / waits for its client at two
              looks / unseen for the bound──► last chance ──nothing heard──► END
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from cdc.wal.looks import WalsenderSample

#: Between two looks at a silent session's walsender: progress is judged over this.
LOOK_EVERY_S = 5.0

#: A look at the walsender (connecting, then its one query) that takes longer has
#: failed: the walsender "cannot be seen". Part of the relay's own bound for a
#: walsender it cannot see (:func:`silence_bound_s`).
LOOK_TIMEOUT_S = 10.0

#: Before a session is ended, the relay asks for a reply once more and listens this
#: long (a walsender that just came out of a long replay answers within a second).
LAST_CHANCE_S = 2.0

#: Wait events of a walsender waiting for its client (case-insensitive: PostgreSQL 17
#: renamed WalSenderWaitForWAL to WalSenderWaitForWal).
IDLE_WAITS = frozenset({"walsenderwaitforwal", "walsendermain", "clientread"})
WRITE_WAITS = frozenset({"walsenderwritedata", "clientwrite"})


class Silence(enum.Enum):
    WAIT = "wait"  # nothing to say yet: listen on (and look again later)
    LEAVE = "leave"  # the walsender is busy inside a record: keep the session
    END = "end"  # the path is dead: end the session (and the walsender)


@dataclass(frozen=True)
class Judgement:
    action: Silence
    #: why, for the log line (the walsender's pid is added by the caller)
    reason: str
    #: whether the caller logs this judgement (LEAVE: once per interval; END: always)
    log: bool = True


def silence_bound_s(configured_s: float) -> float:
    """How long a silent walsender that no look has seen is given before the session ends.

    The relay's own bound: ``CDC_REPLICATION_SILENCE_S`` (when the first look is
    taken) plus the look's own timeout (:data:`LOOK_TIMEOUT_S`), so a dead path
    behind which even a look cannot connect is ended at the first failed look. Not
    the server's ``wal_sender_timeout``: 0 (off) would never end it, and a large one
    would keep a dead path for as long (the regression of issue 49).
    """
    return configured_s + LOOK_TIMEOUT_S


def _moved(now: WalsenderSample, before: WalsenderSample | None) -> str:
    """How far ``sent_lsn`` moved since ``before`` (empty: not, or nothing to compare)."""
    if before is None or not before.found or now.sent_lsn is None or before.sent_lsn is None:
        return ""
    if now.sent_lsn <= before.sent_lsn:
        return ""
    return f"read {now.sent_lsn - before.sent_lsn} bytes of WAL in {now.at_s - before.at_s:.0f}s"


def _read_request(sample: WalsenderSample | None, asked_at_us: int | None) -> bool:
    """The walsender had read a reply request of this silence when ``sample`` was taken."""
    return (
        sample is not None
        and asked_at_us is not None
        and sample.reply_time_us is not None
        and sample.reply_time_us >= asked_at_us
    )


def _decoded(now: WalsenderSample, before: WalsenderSample | None) -> str:
    """Bytes its slot decoded since ``before`` (information only: statistics lag)."""
    if (
        before is None
        or now.decoded_bytes is None
        or before.decoded_bytes is None
        or now.decoded_bytes <= before.decoded_bytes
    ):
        return ""
    return f", {now.decoded_bytes - before.decoded_bytes} bytes decoded since the last look"


def _wait(sample: WalsenderSample) -> str:
    if sample.wait_event is None:
        return "on the CPU (no wait event)"
    return f"waiting on {sample.wait_event_type}/{sample.wait_event}"


def _unseen(unseen_s: float, bound_s: float, unseen: str) -> Judgement:
    if unseen_s > bound_s:
        return Judgement(
            Silence.END,
            f"cannot be seen ({unseen}) and no look has seen it for {unseen_s:.0f}s"
            f" (the relay's bound: {bound_s:.0f}s, CDC_REPLICATION_SILENCE_S plus the"
            f" look's {LOOK_TIMEOUT_S:.0f}s)",
        )
    return Judgement(Silence.WAIT, f"cannot be seen ({unseen}): looking again")


def _waits_for_client(sample: WalsenderSample) -> str | None:
    """``idle`` or ``write`` when the walsender waits for its client, else None."""
    event = (sample.wait_event or "").lower()
    if not sample.found:
        return None
    if event in IDLE_WAITS:
        return "idle"
    if event in WRITE_WAITS:
        return "write"
    return None


def judge(
    *,
    silent_s: float,
    bound_s: float,
    now: WalsenderSample | None,
    before: WalsenderSample | None,
    asked_at_us: int | None = None,
    unseen: str = "",
    unseen_s: float | None = None,
) -> Judgement:
    """The decision after a look (``now``; None: it could not be seen, ``unseen`` says
    why) at a walsender silent for ``silent_s``; ``before``: the previous look of the
    same silence; ``asked_at_us``: when the relay first asked for a reply in this
    silence (its clock, Unix microseconds; None: not yet); ``unseen_s``: how long no
    look has seen it (None: the whole silence). See the module docstring."""
    if now is None:
        return _unseen(silent_s if unseen_s is None else unseen_s, bound_s, unseen)
    if not now.found:
        return Judgement(Silence.END, "is gone on the server")
    moved = _moved(now, before)
    if moved and _read_request(before, asked_at_us):
        return Judgement(
            Silence.END,
            f"had read the relay's reply request and went on ({moved}), yet its answer"
            " never arrived: the path between them is dead",
        )
    waits = _waits_for_client(now)
    if waits is None:
        doing = f"{_wait(now)}, it {moved}" if moved else _wait(now)
        return Judgement(
            Silence.LEAVE,
            f"is working (decoding a large transaction?): {doing}{_decoded(now, before)}",
        )
    stuck = (
        f"is idle ({_wait(now)}) yet did not answer the relay's reply request"
        if waits == "idle"
        else f"is blocked writing to the relay ({_wait(now)})"
    )
    if (
        before is None
        or _waits_for_client(before) != waits
        or now.at_s - before.at_s < LOOK_EVERY_S
    ):
        return Judgement(Silence.WAIT, f"{stuck}: looking again")
    return Judgement(
        Silence.END,
        f"{stuck}, at two looks {now.at_s - before.at_s:.0f}s apart:"
        " the path between it and the relay is dead",
    )


class SilenceWatch:
    """The looks of one streaming session: when to look, what the last look saw,
    when a walsender left alone was last reported."""

    def __init__(self, *, look_after_s: float, bound_s: float) -> None:
        self.look_after_s = look_after_s
        self.bound_s = bound_s
        self._before: WalsenderSample | None = None
        self._next_look_s = -math.inf
        self._reported_s = -math.inf
        self._asked_at_us: int | None = None
        #: when a look of this silence last saw the walsender (monotonic seconds)
        self._seen_at_s: float | None = None
        #: why the last look of this silence failed (None: it saw the walsender)
        self.blind: str | None = None

    def heard(self) -> None:
        """A message arrived: the silence (and what its looks saw) is over."""
        self._before = None
        self._next_look_s = -math.inf
        self._asked_at_us = None
        self._seen_at_s = None
        self.blind = None

    def asking(self, now_us: int) -> None:
        """The relay asks for a reply now (its clock, Unix microseconds)."""
        if self._asked_at_us is None:
            self._asked_at_us = now_us

    def ask_after_s(self, reply_request_after_s: float) -> float:
        """Silence after which the relay asks for a reply: no later than its first look."""
        return min(reply_request_after_s, self.look_after_s)

    def due(self, silent_s: float, now_s: float) -> bool:
        """Whether to look at the walsender now."""
        return silent_s > self.look_after_s and now_s >= self._next_look_s

    def judge(
        self, silent_s: float, now_s: float, look: WalsenderSample | None, unseen: str = ""
    ) -> Judgement:
        """Judge a look taken now; remembers it for the next one."""
        seen_at_s = self._seen_at_s
        verdict = judge(
            silent_s=silent_s,
            bound_s=self.bound_s,
            now=look,
            before=self._before,
            asked_at_us=self._asked_at_us,
            unseen=unseen,
            unseen_s=None if seen_at_s is None else min(silent_s, now_s - seen_at_s),
        )
        self._next_look_s = now_s + LOOK_EVERY_S
        if look is not None:
            self._before = look
            self._seen_at_s = now_s
            self.blind = None
        else:
            self.blind = (
                f"replication connection silent for {silent_s:.0f}s and its walsender"
                f" cannot be seen ({unseen or 'the look failed'})"
            )
        if verdict.action is Silence.LEAVE:
            if now_s - self._reported_s < self.look_after_s:
                return Judgement(verdict.action, verdict.reason, log=False)
            self._reported_s = now_s
        elif verdict.action is Silence.WAIT:
            return Judgement(verdict.action, verdict.reason, log=False)
        return verdict
