"""librdkafka's own errors and log lines, routed into the process's logging and metrics.

Every Kafka client of the project (the relay's producer, the sink's consumer,
admin clients of the ops tools) takes :meth:`KafkaClientEvents.config` into its
configuration. Guarantees:

* every error librdkafka reports through ``error_cb`` is counted by its code
  name (``_TRANSPORT``, ``_ALL_BROKERS_DOWN``, ``_FATAL``, ...: librdkafka's
  fixed set of codes, so the metric's label set is bounded) and logged with the
  fields ``kafka_client``, ``kafka_error`` and ``fatal``;
* a repeated error is logged once when it first appears and then at most once
  every :data:`REPEAT_LOG_S` with the number of repeats, so a broker outage
  does not flood the log; the metric still counts every one;
* a fatal error (``err.fatal()``, e.g. an idempotent producer fenced or out of
  sequence) is kept in :attr:`KafkaClientEvents.fatal` so the owner can
  rebuild its client: librdkafka cannot recover one by itself. confluent-kafka
  does not hand fatal errors to ``error_cb``: it raises them as a
  ``KafkaException`` from the call that serves callbacks (``poll``, ``flush``,
  ``consume``), and ``produce`` raises ``_FATAL`` afterwards. The owner routes
  such an exception through :meth:`KafkaClientEvents.raised`, which counts,
  logs and keeps it exactly like an ``error_cb`` error;
* librdkafka's log lines go to the logger ``kafka.<client>`` (confluent-kafka
  maps syslog levels to logging levels), in whichever format (text or JSON)
  the process uses; they are served by the client's ``poll``/``consume``.
  They are rate-limited like errors (:class:`RateLimitedLog`): a line is
  written the first time its *kind* appears (facility and text with the
  numbers masked, so ``Connect to ... failed (after 3ms ...)`` repeated by
  every broker thread every second is one kind), then at most once every
  :data:`REPEAT_LOG_S` with the number of lines held back. A broker outage of
  an hour writes a handful of lines per client, not thousands;
* a client built with ``reach=True`` also says whether it reaches a broker *now*
  (:class:`KafkaReach`, from librdkafka's own statistics every
  :data:`STATS_INTERVAL_MS`): the relay's producer and the sink's consumer, whose
  ``/readyz`` turn 503 ``kafka unreachable: <why>`` from it;
* every librdkafka client of the project is built with :meth:`config`
  (relay producer and admin, sink consumer and lag reader, backlog guard, ops
  commands, trace, redelivery, idempotent toolkit): there is no other path.

The callbacks run on the thread that serves the client (``poll``, ``consume``,
``flush``); they only log, count and store, so they are safe on any thread.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from confluent_kafka import KafkaError, KafkaException

log = logging.getLogger(__name__)

#: A repeated error or log line is logged again at most this often (with its repeat count).
REPEAT_LOG_S = 60.0
#: Distinct kinds of log line remembered per client (the oldest is forgotten first).
MAX_LOG_KINDS = 256
#: Numbers in a librdkafka log line (timings, counts, ports) do not make a new kind.
_NUMBERS = re.compile(r"\d+")
#: librdkafka's own repeat note ("..., 12 identical error(s) suppressed") is not a new kind.
_SUPPRESSED = re.compile(r",? ?\d+ identical error\(s\) suppressed")
#: Errors that say only that no broker is up, not why: never a client's :attr:`cause`.
CAUSELESS_ERRORS = frozenset({"_ALL_BROKERS_DOWN"})
#: librdkafka's statistics of a ``reach=True`` client come this often: a broker that goes
#: away is seen within about this long (one small JSON document parsed per interval).
STATS_INTERVAL_MS = 1000
#: librdkafka broker states of a working connection.
_UP_STATES = frozenset({"UP", "UPDATE"})


class KafkaReach:
    """Whether one client reaches any broker now, from librdkafka's statistics and errors.

    Unreachable means: the last statistics show no broker connection ``UP`` and the
    client reported an error (a refused connect, a TLS handshake, all brokers down)
    since it last saw one up. Level, not an old flag: the next statistics with a broker
    up clear it. A client that has tried nothing (sparse connections: every broker
    ``INIT``, no error) is not unreachable; neither is one before its first statistics.
    librdkafka forgets a learned broker that went away and keeps retrying its bootstrap
    address, whose state reads ``INIT`` between attempts: the errors, not the state,
    say that it is failing. Written on the thread that serves the client, read on any
    (one tuple swapped at a time).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: (when the last statistics came, since when no broker is reachable or None)
        self._seen: tuple[float, float | None] = (clock(), None)
        self._last_up = clock()
        self._failed_at: float | None = None

    def failed(self) -> None:
        """The client reported an error (its ``error_cb``)."""
        self._failed_at = self._clock()

    def on_stats(self, document: str) -> None:
        """librdkafka's ``stats_cb``: the JSON statistics of the client."""
        try:
            brokers = orjson.loads(document).get("brokers") or {}
            up = any(str(b.get("state", "")) in _UP_STATES for b in brokers.values())
        except (orjson.JSONDecodeError, AttributeError):
            return
        now = self._clock()
        if up:
            self._last_up = now
            self._seen = (now, None)
            return
        failed = self._failed_at is not None and self._failed_at >= self._last_up
        since = self._seen[1]
        self._seen = (now, (since if since is not None else now) if failed else None)

    def unreachable_s(self, *, progress_at: float | None = None) -> float | None:
        """Seconds without any broker reachable as of the last statistics, or None.

        ``progress_at`` (the owner's last evidence of a working broker, e.g. an
        acknowledgement): statistics older than it are overruled - reachable.
        """
        at, since = self._seen
        if since is None or (progress_at is not None and progress_at >= at):
            return None
        return at - since


class RateLimitedLog:
    """A ``logger`` for confluent-kafka that writes each kind of line at most once per period.

    confluent-kafka calls ``log(level, "%s [%s] %s", facility, client, text)``.
    The kind is (level, facility, text with numbers masked); the first line of
    a kind is written, repeats within :data:`REPEAT_LOG_S` are counted and the
    next line written after the period says how many were held back. Debug
    lines (only with librdkafka's ``debug`` setting) are written in full.
    """

    def __init__(
        self, logger: logging.Logger, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self._clock = clock
        self._lock = threading.Lock()
        self._kinds: OrderedDict[tuple[int, str], list[float]] = OrderedDict()  # [last, held]
        #: While set, nothing is written (see :meth:`KafkaClientEvents.held`).
        self.muted = False

    @property
    def name(self) -> str:
        """The logger's name (``kafka.<client>``)."""
        return self.logger.name

    def log(self, level: int, msg: str, *args: Any) -> None:
        if self.muted or not self.logger.isEnabledFor(level):
            return
        text = msg % args if args else msg
        if level < logging.INFO:  # librdkafka's debug output (KAFKA_CONFIG_DEBUG): all of it
            self.logger.log(level, "%s", text)
            return
        kind = (level, _NUMBERS.sub("#", _SUPPRESSED.sub("", text)))
        with self._lock:
            now = self._clock()
            state = self._kinds.get(kind)
            if state is not None and now - state[0] < REPEAT_LOG_S:
                state[1] += 1
                return
            held = int(state[1]) if state is not None else 0
            self._kinds[kind] = [now, 0]
            self._kinds.move_to_end(kind)
            while len(self._kinds) > MAX_LOG_KINDS:
                self._kinds.popitem(last=False)
        more = f" ({held} more since last logged)" if held else ""
        self.logger.log(level, "%s%s", text, more)


class KafkaClientEvents:
    """Receives one client's ``error_cb`` and log lines; see the module docstring.

    ``count`` is called with the error's code name for each error (a metric's
    ``labels(code).inc``, say); ``on_fatal`` is called once for a fatal error.
    """

    def __init__(
        self,
        client: str,
        *,
        count: Callable[[str], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_error: Callable[[str, str], None] | None = None,
        reach: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_error(code, text)`` is called after each error is recorded; ``reach``
        adds librdkafka's statistics (:attr:`reach`)."""
        self.client = client
        self._on_error = on_error
        #: Whether the client reaches a broker now (``reach=True`` only).
        self.reach: KafkaReach | None = KafkaReach(clock) if reach else None
        self._count = count
        self._on_fatal = on_fatal
        self._clock = clock
        self._lock = threading.Lock()
        self._last_logged: dict[str, float] = {}  # code -> when it was last logged
        self._repeats: dict[str, int] = {}  # code -> errors not logged since then
        #: The fatal error's text once librdkafka reported one; the client is dead.
        self.fatal: str | None = None
        #: The most recent error's code name and text (readiness reasons).
        self.last_error: tuple[str, str] | None = None
        #: The most recent error that says why a broker connection failed (an SSL
        #: handshake, an authentication: not :data:`CAUSELESS_ERRORS`), for a command's
        #: one error line (:func:`cdc.kafka.client.first_contact`).
        self.cause: tuple[str, str] | None = None
        #: confluent-kafka maps librdkafka's syslog levels to logging levels itself.
        self.logger = logging.getLogger(f"kafka.{client}")
        self.log_lines = RateLimitedLog(self.logger, clock=clock)

    def config(self) -> dict[str, Any]:
        """The client settings that route errors and (rate-limited) log lines here (and
        librdkafka's statistics, for a client with :attr:`reach`)."""
        config: dict[str, Any] = {"error_cb": self.on_error, "logger": self.log_lines}
        if self.reach is not None:
            config["stats_cb"] = self.reach.on_stats
            config["statistics.interval.ms"] = STATS_INTERVAL_MS
        return config

    def why_unreachable(self) -> str:
        """The client's last word on why no broker answers (for ``kafka unreachable: ...``)."""
        with self._lock:
            found = self.cause or self.last_error
        return found[1] if found is not None else "no broker connection is up"

    @contextmanager
    def held(self) -> Iterator[None]:
        """Write no error or log line inside (still count): for a command's first contact,
        whose failure the command reports as its one ``error:`` line."""
        self.log_lines.muted = True
        try:
            yield
        finally:
            self.log_lines.muted = False

    def on_error(self, err: Any) -> None:
        """librdkafka's ``error_cb``: count, log (rate-limited), remember a fatal one."""
        self._report(str(err.name()), str(err.str()), is_fatal=bool(err.fatal()))

    def raised(self, exc: BaseException) -> bool:
        """Route an exception a client call raised; True when it carries a fatal error.

        A ``KafkaException`` whose error is fatal (or ``_FATAL``, as ``produce``
        raises once the client is dead) is counted, logged and kept as
        :attr:`fatal`, like an ``error_cb`` error; anything else is left alone.
        """
        err = fatal_error(exc)
        if err is None:
            return False
        self._report(str(err.name()), str(err.str()), is_fatal=True)
        return True

    def _report(self, code: str, text: str, *, is_fatal: bool) -> None:
        if self._count is not None:
            self._count(code)
        if self.reach is not None:
            self.reach.failed()
        with self._lock:
            self.last_error = (code, text)
            if code not in CAUSELESS_ERRORS:
                self.cause = (code, text)
        if self._on_error is not None:
            self._on_error(code, text)
        with self._lock:
            now = self._clock()
            last = self._last_logged.get(code)
            quiet = not is_fatal or self.fatal is not None  # a dead client's repeats too
            if quiet and last is not None and now - last < REPEAT_LOG_S:
                self._repeats[code] = self._repeats.get(code, 0) + 1
                return
            repeats = self._repeats.pop(code, 0)
            self._last_logged[code] = now
            if is_fatal and self.fatal is None:
                self.fatal = text
                first_fatal = True
            else:
                first_fatal = False
        more = f" ({repeats} more since last logged)" if repeats else ""
        if self.log_lines.muted and not is_fatal:
            return
        log.log(
            logging.ERROR if is_fatal else logging.WARNING,
            "kafka %s error %s: %s%s",
            self.client,
            code,
            text,
            more,
            extra={"kafka_client": self.client, "kafka_error": code, "fatal": is_fatal},
        )
        if first_fatal and self._on_fatal is not None:
            self._on_fatal(text)

    def clear_fatal(self) -> None:
        """The owner rebuilt its client: forget the fatal error."""
        with self._lock:
            self.fatal = None


def fatal_error(exc: BaseException) -> Any | None:
    """The fatal ``KafkaError`` ``exc`` carries, else None (see ``KafkaClientEvents.raised``)."""
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if isinstance(err, KafkaError) and (err.fatal() or err.code() == KafkaError._FATAL):
        return err
    return None
