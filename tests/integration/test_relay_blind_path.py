"""A replication path that passes nothing is seen whatever the server's settings (issue 49, item 1).

Real PostgreSQL behind :class:`tests.tcpfault.TcpFaultProxy`, which stops passing
bytes both ways for :data:`SILENCE_S` - the open connections and every new one (a
frozen host, a dropped NAT entry): the silence detector's look at the walsender goes
over the same dead path and cannot connect. The server's ``wal_sender_timeout`` is 0
(it never ends the walsender) or 60 s. Before issue 49 the relay trusted the server's
promise for a walsender it could not see: with 0 it waited for ever, ``/readyz`` 200
for the whole silence while events piled up. Now, whatever ``wal_sender_timeout``:

* the session is ended within the relay's own bound (``CDC_REPLICATION_SILENCE_S``
  plus the look's timeout, :func:`cdc.relay.health.silence.silence_bound_s`, plus the last
  chance);
* ``/readyz`` answers 503 naming the silence and the failed look from then until
  the path is back, never 200 in between;
* once the path is back: every event written meanwhile arrives, and exactly one
  walsender of this relay holds the slot (the orphan was taken back or ended).

The busy walsender that must be left alone is ``test_relay_connections.py``'s large
transaction; the silence behind a proxy whose new connections pass (the look sees the
walsender) is ``test_relay_network_faults.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cdc.relay.health.silence import LAST_CHANCE_S, silence_bound_s
from tests.harness import RelayConfig, drop_slot, start_relay, wait_until
from tests.integration.test_relay_errors import ReadyzSampler, metric
from tests.integration.test_relay_network_faults import Writer, _assert_all_arrived
from tests.tcpfault import TcpFaultProxy

pytestmark = pytest.mark.integration

#: How long the path passes nothing (the issue's measurement).
SILENCE_S = 90.0
#: The relay's silence setting in this test.
LOOK_AFTER_S = 5.0


@pytest.fixture
def cfg(db_dsn: str, kafka_bootstrap: str, unique: str) -> Iterator[RelayConfig]:
    config = RelayConfig(db_dsn=db_dsn, kafka=kafka_bootstrap, unique=unique, partitions=2)
    yield config
    drop_slot(db_dsn, config.slot)


def _walsenders_of(dsn: str, relay_pid: int) -> list[int]:
    """The walsenders of the relay process ``relay_pid`` (by its application_name)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'"
            " AND application_name LIKE %s",
            (f"outbox-cdc relay pid={relay_pid} %",),
        ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.parametrize("wal_sender_timeout", ["0", "60s"])
def test_a_path_that_passes_nothing_is_ended_within_the_relays_bound(
    cfg: RelayConfig, tmp_path: Path, wal_sender_timeout: str
) -> None:
    target = conninfo_to_dict(cfg.db_dsn)
    with TcpFaultProxy(
        str(target.get("host", "127.0.0.1")), int(target.get("port", 5432))
    ) as proxy:
        via_proxy = make_conninfo(
            cfg.db_dsn,
            host="127.0.0.1",
            port=str(proxy.port),
            options=f"-c wal_sender_timeout={wal_sender_timeout}",
        )
        cfg.extra = {
            "CDC_PG_DSN": via_proxy,
            "CDC_REPLICATION_SILENCE_S": str(LOOK_AFTER_S),
            "CDC_AUDIT_INTERVAL_S": "0",
        }
        relay, port = start_relay(cfg, tmp_path)
        try:
            with Writer(cfg.db_dsn, "blind") as writer:
                relayed = "outbox_relay_events_total"
                labels = f'topic="{cfg.topic_prefix}blind"'
                wait_until(lambda: metric(port, relayed, labels) >= 20, 60, "events relayed")
                with ReadyzSampler(port) as sampler:
                    silenced_at = time.monotonic()
                    proxy.silence(new_connections=True)  # the look cannot connect either
                    wait_until(
                        lambda: metric(port, "outbox_relay_replication_silences_total") >= 1,
                        SILENCE_S - 10,
                        "the relay to end the silent session",
                    )
                    noticed_s = time.monotonic() - silenced_at
                    bound_s = silence_bound_s(LOOK_AFTER_S) + LAST_CHANCE_S
                    print(
                        f"\nwal_sender_timeout={wal_sender_timeout}: session ended"
                        f" {noticed_s:.1f}s into the silence (the relay's bound {bound_s:.0f}s"
                        " plus a read turn; shared 2-core machine)"
                    )
                    time.sleep(max(0.0, SILENCE_S - (time.monotonic() - silenced_at)))
                    during = list(sampler.seen)
                    proxy.resume()
                after = metric(port, relayed, labels)
                wait_until(
                    lambda: metric(port, relayed, labels) >= after + 20,
                    120,
                    "a new session streaming once the path is back",
                )
            _assert_all_arrived(cfg, "blind", writer.ids)
            first_503 = next(i for i, (code, _) in enumerate(during) if code == 503)
            named = [
                body
                for code, body in during[first_503:]
                if "silent for" in body and "cannot be seen" in body
            ]
            assert named, f"/readyz never named the silence and the failed look: {during}"
            assert all(code == 503 for code, _ in during[first_503:]), (
                f"/readyz said 200 again while the path passed nothing: {during}"
            )
            # the orphan (the walsender behind the dead path) is gone: one walsender left
            wait_until(
                lambda: len(_walsenders_of(cfg.db_dsn, relay.pid)) == 1,
                60,
                "exactly one walsender of this relay once the path is back",
            )
            log = relay.log_path.read_text()
            assert "cannot be seen" in log and "no look has seen it for" in log
            assert relay.alive(), relay.log_tail()
        finally:
            relay.close()
