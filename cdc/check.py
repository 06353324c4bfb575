"""``outbox-cdc check``: the preflight an operator runs before the first start and after a change.

What it is for: one answer to "will the relay and the sink work with these
settings?", item by item, each ``ok``, ``warn`` or ``fail`` with one line that
names what to fix (the variable, the SQL, the command).

Guarantees:

* it changes nothing: it reads settings, catalogs and metadata, and sends the
  engine one request it refuses by design (see :mod:`sinks.cli.check`);
* a probe that raises becomes a ``fail`` finding of its own (the other items
  still run); a finding never holds a secret (psycopg's messages never hold
  the DSN's password, the settings' errors never a secret's value);
* the kernel's probes (:data:`KERNEL_PROBES`) cover PostgreSQL and Kafka; other
  packages add theirs through their :class:`cdc.cli.app.Plugin` (``checks``),
  so ``cdc`` imports nothing of :mod:`sinks`;
* ``fail`` means the processes will not work as configured (exit 1); ``warn``
  means they will, with something the operator should know.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from cdc.settings import Settings
from cdc.settings.values import redact_dsn

if TYPE_CHECKING:
    from cdc.wal.standby_copy import StandbyCopy

#: How long one probe waits for PostgreSQL or Kafka before it reports them unreachable.
PROBE_TIMEOUT_S = 5.0
#: ``wal_status`` values of a slot that still has every WAL segment it needs.
WAL_KEPT = frozenset({"reserved", "extended"})


class Status(StrEnum):
    """One finding's verdict."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class Finding:
    """One checked item: what, the verdict, and one line of detail (the fix when not ok)."""

    item: str
    status: Status
    detail: str

    def as_json(self) -> dict[str, str]:
        return {"item": self.item, "status": self.status.value, "detail": self.detail}


#: A probe: findings about one part of the deployment, from the settings.
Probe = Callable[[Settings], Iterable[Finding]]


def ok(item: str, detail: str) -> Finding:
    return Finding(item, Status.OK, detail)


def warn(item: str, detail: str) -> Finding:
    return Finding(item, Status.WARN, detail)


def fail(item: str, detail: str) -> Finding:
    return Finding(item, Status.FAIL, detail)


def run_probes(settings: Settings, probes: Sequence[tuple[str, Probe]]) -> list[Finding]:
    """Every probe's findings in order; a probe that raises is one ``fail`` finding."""
    findings: list[Finding] = []
    for name, probe in probes:
        try:
            findings.extend(probe(settings))
        except Exception as exc:
            findings.append(fail(name, f"{type(exc).__name__}: {exc}"))
    return findings


# --- PostgreSQL ----------------------------------------------------------------------------


def postgres(settings: Settings) -> Iterator[Finding]:
    """Reachable, ``wal_level``, the role's privileges, the outbox, publication and slot."""
    import psycopg  # noqa: PLC0415 - this module is imported with the CLI: keep --help fast

    from cdc.pgconn import Use, connect  # noqa: PLC0415 - (the same)

    if not settings.pg_dsn.get_secret_value():
        yield fail("postgresql", "CDC_PG_DSN is not set")
        return
    try:
        conn = connect(
            settings.pg_dsn.get_secret_value(),
            Use.CLI,
            connect_timeout=max(1, int(PROBE_TIMEOUT_S)),
        )
    except psycopg.Error as exc:
        where = redact_dsn(settings.pg_dsn.get_secret_value())
        yield fail("postgresql", f"cannot connect ({where}): {exc}; check CDC_PG_DSN")
        return
    with conn:
        version = _one(conn, "SHOW server_version")
        yield ok(
            "postgresql", f"reachable, PostgreSQL {version}, as {_one(conn, 'SELECT current_user')}"
        )
        yield from _wal_level(conn)
        yield from _privileges(conn)
        yield from _outbox_and_publication(conn, settings)
        yield from _slot(conn, settings)
        yield from failover_slots(conn, settings)


def _one(conn: Any, query: str, params: tuple[object, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


def _wal_level(conn: Any) -> Iterator[Finding]:
    level = _one(conn, "SHOW wal_level")
    if level == "logical":
        yield ok("wal_level", "logical")
    else:
        yield fail(
            "wal_level",
            f"{level!r}: set wal_level = logical in postgresql.conf and restart PostgreSQL",
        )


def _privileges(conn: Any) -> Iterator[Finding]:
    superuser, replication = conn.execute(
        "SELECT rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user"
    ).fetchone()
    if superuser or replication:
        yield ok("replication privilege", "superuser" if superuser else "REPLICATION")
    else:
        yield fail(
            "replication privilege",
            "the role lacks REPLICATION: ALTER ROLE <role> REPLICATION"
            " (sql/roles/relay_role.sql has the least-privilege role)",
        )


def _outbox_and_publication(conn: Any, settings: Settings) -> Iterator[Finding]:
    table = settings.outbox_table
    if not _one(conn, "SELECT to_regclass(%s) IS NOT NULL", (table,)):
        yield fail("outbox table", f"{table} does not exist: run `outbox-cdc migrate`")
        return
    yield ok("outbox table", table)
    row = conn.execute(
        "SELECT pg_get_userbyid(pubowner), pg_get_userbyid(pubowner) = current_user"
        " OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)"
        " FROM pg_publication WHERE pubname = %s",
        (settings.publication,),
    ).fetchone()
    if row is None:
        yield from _publication_creatable(conn, settings)
        return
    owner, usable = row
    # (names compared, not casts to regclass: a cast of every published name, evaluated
    # before the filter, needs USAGE on schemas such as pg_toast a least-privileged role lacks)
    published = _one(
        conn,
        "SELECT count(*) FROM pg_publication_tables t, pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE t.pubname = %s AND c.oid = %s::regclass"
        " AND (t.schemaname, t.tablename) = (n.nspname, c.relname)",
        (settings.publication, table),
    )
    if not published:
        yield fail(
            "publication",
            f"{settings.publication} does not publish {table}: ALTER PUBLICATION"
            f" {settings.publication} ADD TABLE {table} (as its owner {owner})",
        )
    elif not usable:
        yield warn(
            "publication",
            f"{settings.publication} is owned by {owner}, not this role: fine for streaming;"
            " changing it needs its owner",
        )
    else:
        yield ok("publication", f"{settings.publication} publishes {table} (owner {owner})")


def _publication_creatable(conn: Any, settings: Settings) -> Iterator[Finding]:
    can_create = _one(
        conn,
        "SELECT has_database_privilege(current_database(), 'CREATE')"
        " AND pg_has_role((SELECT relowner FROM pg_class WHERE oid = %s::regclass), 'USAGE')",
        (settings.outbox_table,),
    )
    if can_create:
        yield ok("publication", f"{settings.publication} not yet created; the relay may create it")
    else:
        yield fail(
            "publication",
            f"{settings.publication} does not exist and this role may not create it:"
            " run `outbox-cdc migrate` as the outbox table's owner",
        )


def _slot(conn: Any, settings: Settings) -> Iterator[Finding]:
    row = conn.execute(
        "SELECT plugin, active, wal_status, database = current_database()"
        " FROM pg_replication_slots WHERE slot_name = %s",
        (settings.slot,),
    ).fetchone()
    item = f"slot {settings.slot}"
    if row is None:
        yield ok(item, "not yet created: the relay creates it at its first start")
        return
    plugin, active, wal_status, same_db = row
    if plugin != "pgoutput" or not same_db:
        yield fail(
            item,
            f"belongs to another plugin ({plugin}) or database: choose another CDC_SLOT",
        )
    elif wal_status == "lost":
        from cdc.wal.slots import read_slot  # noqa: PLC0415 - see postgres()

        found = read_slot(conn, settings.slot)
        reason = found.invalidated if found is not None else None
        yield fail(
            item,
            f"invalidated ({reason or 'wal_status lost'}): the relay cannot stream it; at its"
            " next start it reports a gap and recovers it from the outbox table"
            " (CDC_GAP_RECOVERY=manual: `outbox-cdc slot recover --execute`)",
        )
    elif wal_status not in WAL_KEPT:
        yield warn(item, f"wal_status {wal_status}: WAL is about to be removed; start the relay")
    else:
        yield ok(item, f"{'active' if active else 'inactive'}, wal_status {wal_status}")


# --- failover slots (PostgreSQL 17+) ----------------------------------------------------------

#: ``server_version_num`` of the first server with failover slots (PostgreSQL 17).
FAILOVER_MIN_VERSION = 170_000

#: The primary's standbys: each walsender of a physical standby, its physical slot (when it
#: streams through one), whether it sends hot_standby_feedback (an xmin on its walsender or
#: its slot), and whether a non-replication connection of the same application_name and
#: address is open - the standby's slot synchronization (sync_replication_slots, connecting
#: with primary_conninfo, which must name a database for it).
STANDBYS_SQL = """
SELECT r.application_name, s.slot_name,
       r.backend_xmin IS NOT NULL OR s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_stat_activity a
               WHERE a.backend_type = 'client backend' AND a.datname IS NOT NULL
                 AND a.client_addr IS NOT DISTINCT FROM r.client_addr
                 AND (a.application_name = r.application_name
                      OR a.application_name LIKE '%%slotsync%%'))
FROM pg_stat_replication r
LEFT JOIN pg_replication_slots s ON s.active_pid = r.pid AND s.slot_type = 'physical'
WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots l
                  WHERE l.active_pid = r.pid AND l.slot_type = 'logical')
ORDER BY 1
"""


def failover_slots(conn: Any, settings: Settings) -> Iterator[Finding]:
    """Whether the relay's slot is a failover slot, and whether a standby will carry it."""
    version = conn.info.server_version
    major = version // 10_000
    setting = settings.failover_slot
    item = "failover slot"
    if version < FAILOVER_MIN_VERSION:
        if setting == "on":
            yield fail(
                item,
                f"CDC_FAILOVER_SLOT=on but PostgreSQL {major} has no failover slots (17+):"
                " set CDC_FAILOVER_SLOT=auto or off",
            )
        else:
            yield ok(
                item,
                f"PostgreSQL {major} has none (17+): after a failover the relay recovers the"
                " gap from the outbox table (duplicates, no loss)",
            )
        return
    if setting == "off":
        yield ok(item, "CDC_FAILOVER_SLOT=off: after a failover the relay recovers the gap")
        return
    is_failover = _one(
        conn, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (settings.slot,)
    )
    if is_failover is False:
        yield warn(
            item,
            f"slot {settings.slot} is not a failover slot yet: the relay makes it one at its"
            " next start (CDC_FAILOVER_SLOT)",
        )
    elif is_failover is None:
        yield ok(item, f"the relay creates slot {settings.slot} as a failover slot")
    else:
        yield ok(item, f"slot {settings.slot} is a failover slot (CDC_FAILOVER_SLOT={setting})")
    yield from _standbys_carry_slot(conn, settings)


def _synchronized_standby_slots(conn: Any, settings: Settings) -> Iterator[Finding]:
    """The primary's synchronized_standby_slots: a name that holds the failover slot's
    decoding back fails (the relay would stream nothing); one no standby streams from
    (not behind yet) warns."""
    from cdc.wal.slots import decoding_held_back, standby_slot_names  # noqa: PLC0415

    listed = str(_one(conn, "SHOW synchronized_standby_slots") or "")
    active = {
        str(name)
        for (name,) in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND active"
        )
    }
    held = decoding_held_back(conn, settings.slot, failover=True)
    for line in held:
        yield fail("synchronized_standby_slots", line)
    for name in sorted(set(standby_slot_names(listed)) - active):
        if not any(f" names {name}, " in line for line in held):
            yield warn(
                "synchronized_standby_slots",
                f"names {name}, which no standby streams from now: the relay's failover slot"
                " gets nothing until it is back; bring that standby up or remove it from the"
                " list",
            )


def _standbys_carry_slot(conn: Any, settings: Settings) -> Iterator[Finding]:
    """Each standby of this primary: will it carry the slot through a failover?"""
    from cdc.wal.slots import standby_slot_names  # noqa: PLC0415

    names = set(standby_slot_names(str(_one(conn, "SHOW synchronized_standby_slots") or "")))
    yield from _synchronized_standby_slots(conn, settings)
    standbys = conn.execute(STANDBYS_SQL).fetchall()
    if not standbys:
        yield ok(
            "standby",
            "no standby streams from this server: a failover would be recovered as a gap",
        )
    for app, slot, feedback, syncing in standbys:
        item = f"standby {app or '(no application_name)'}"
        fixes = []
        if not syncing:
            fixes.append(
                "sync_replication_slots = on, and a dbname in primary_conninfo (on the standby)"
            )
        if not feedback:
            fixes.append("hot_standby_feedback = on (on the standby)")
        if slot is None:
            fixes.append("primary_slot_name (the standby streams without a physical slot)")
        elif slot not in names:
            fixes.append(
                f"synchronized_standby_slots = '{slot}' (on this primary: the relay then gets"
                " nothing that standby has not)"
            )
        if fixes:
            yield warn(
                item,
                "will not carry the slot through a failover (a gap recovery would): set "
                + "; ".join(fixes),
            )
        else:
            yield ok(
                item,
                f"carries slot {settings.slot}: synchronizes slots, sends feedback, physical"
                f" slot {slot} in synchronized_standby_slots",
            )
    yield from _standby_hosts(settings)


def _standby_hosts(settings: Settings) -> Iterator[Finding]:
    """A multi-host CDC_PG_DSN: each standby's own settings and its copy of the slot
    (:func:`cdc.wal.standby_copy.look_at_standbys`, the look the relay's /readyz reads)."""
    from cdc.pgconn import Use  # noqa: PLC0415 - see postgres()
    from cdc.wal.standby_copy import look_at_standbys  # noqa: PLC0415 - (the same)

    dsn = settings.pg_dsn.get_secret_value()
    for copy in look_at_standbys(dsn, settings.slot, timeout_s=PROBE_TIMEOUT_S, use=Use.CLI):
        yield standby_copy_finding(copy, settings.slot)


def standby_copy_finding(copy: StandbyCopy, slot: str) -> Finding:
    """One standby host's answer as the preflight says it."""
    from cdc.wal.standby_copy import Carry  # noqa: PLC0415 - see postgres()

    item = f"standby {copy.where}"
    if copy.carry is Carry.UNKNOWN:
        return warn(item, f"cannot tell whether it carries slot {slot}: {copy.why}")
    if copy.fixes:
        return warn(
            item, "will not carry the slot (a gap recovery would): set " + "; ".join(copy.fixes)
        )
    if copy.carry is Carry.MISSING:
        return warn(item, f"set up to carry slots, but holds no synchronized {slot} yet")
    if copy.carry is Carry.NOT_YET:
        return warn(
            item,
            f"holds only a temporary copy of slot {slot} (kept until the slot's catalog xmin"
            " passes the standby's own): not yet for good - a failover now is recovered as a"
            " gap (nothing lost); check again in a minute",
        )
    return ok(item, f"holds slot {slot} for good (synced, not temporary)")


# --- Kafka ---------------------------------------------------------------------------------


def kafka(settings: Settings) -> Iterator[Finding]:
    """Brokers reachable; the outbox topics and their partition counts."""
    from confluent_kafka import KafkaException  # noqa: PLC0415 - see postgres()
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415

    from cdc.kafka.client import served_cause, unreachable  # noqa: PLC0415
    from cdc.kafka.log import KafkaClientEvents  # noqa: PLC0415

    if not settings.kafka_bootstrap_servers:
        yield fail("kafka", "KAFKA_BOOTSTRAP_SERVERS is not set")
        return
    # librdkafka's own lines stay out of the preflight's answer (it reports the failure).
    events = KafkaClientEvents("check")
    conf: dict[str, Any] = {
        **settings.kafka_config,
        "bootstrap.servers": settings.kafka_bootstrap_servers,
        **events.config(),
    }
    admin = AdminClient(conf)
    try:
        with events.held():
            metadata = admin.list_topics(timeout=PROBE_TIMEOUT_S)
    except KafkaException as exc:
        # what failed, as a command's first contact says it (TLS and SASL refusals by name)
        with events.held():
            cause = served_cause(admin, events)
        error = unreachable(
            settings.kafka_bootstrap_servers,
            exc,
            cause=cause,
            security_protocol=conf.get("security.protocol", "plaintext"),
        )
        yield fail("kafka", str(error))
        return
    yield ok("kafka", f"reachable, {len(metadata.brokers)} broker(s)")
    yield from _topics(settings, {t: len(m.partitions) for t, m in metadata.topics.items()})


def _topics(settings: Settings, partitions: dict[str, int]) -> Iterator[Finding]:
    ours = {
        t: n
        for t, n in partitions.items()
        if t.startswith(settings.topic_prefix) and not settings.is_checkpoint_topic(t)
    }
    want = settings.topic_partitions
    if not ours:
        yield ok("topics", f"none named {settings.topic_prefix}* yet: the relay creates them")
    for topic, count in sorted(ours.items()):
        if count == want:
            yield ok(f"topic {topic}", f"{count} partitions")
        else:
            yield warn(
                f"topic {topic}",
                f"{count} partitions, CDC_TOPIC_PARTITIONS={want}: keys map to partitions by"
                " the topic's own count (murmur2 % partitions); align them or set the variable",
            )
    dlq = settings.dlq_topic
    if dlq in partitions:
        yield ok(f"topic {dlq}", "dead-letter topic exists")
    else:
        yield ok(f"topic {dlq}", "dead-letter topic not yet created: the relay creates it")


#: The kernel's probes, in the order of the answer.
KERNEL_PROBES: tuple[tuple[str, Probe], ...] = (("postgresql", postgres), ("kafka", kafka))
