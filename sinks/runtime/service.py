"""Wires the sink process: consumer loop, admin/metrics server, parking-lot scheduler.

All three run on one asyncio event loop; SIGTERM stops the consumer (which
drains in-flight deliveries and commits), then the server and scheduler. Before the
consumer joins its group (and before the scheduler starts), ``run_sink`` awaits what the
command hands it as ``admit``: ``outbox-cdc sink`` checks a group without committed
offsets (:mod:`sinks.ops.new_group`), so a start from the log start that nobody chose
is refused, exit 2.
The consumer's parks use a parking-lot connection of their own; the admin API
and the scheduler share another: a park waiting on a locked
``failed_sync_events`` never queues an admin request, and every wait on
either is bounded (:mod:`sinks.parking.lot`), so the admin API answers 503,
never hangs.
uvicorn's own log lines go through the process's logging set-up
(``log_config=None``), so ``LOG_FORMAT=json`` applies to them too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from cdc import collector
from cdc.health import Liveness
from cdc.settings import Settings
from sinks.engine.client import EngineClient
from sinks.http.app import create_app
from sinks.http.guard import MAX_HEADER_BYTES
from sinks.parking.lot import LotTimeouts, ParkingLot
from sinks.parking.retrier import Retrier, Scheduler
from sinks.runtime.sink import Sink

log = logging.getLogger("sinks.service")  # the name operators filter on: kept across moves

#: After the consumer stopped, the admin server and the scheduler get this long to end.
SERVICE_STOP_S = 3.0


#: Wraps the sink's HTTP app with more routes before it is served (``outbox-cdc sink``: the
#: operator console, :func:`sinks.console.app.mount_console`), given the sink's own objects.
HttpMount = Callable[..., ASGIApp]

#: Asked before the consumer joins its group (settings, liveness, the stop event): True to
#: join, False to end without joining; it may raise to refuse the start.
Admission = Callable[[Settings, Liveness, asyncio.Event], Awaitable[bool]]


async def run_sink(
    settings: Settings,
    *,
    install_signals: bool = True,
    admit: Admission | None = None,
    mount: HttpMount | None = None,
) -> int:
    """Run until SIGTERM/SIGINT; return the exit code. ``admit`` (``outbox-cdc sink``: the
    new-group guard, :func:`sinks.ops.new_group.guard_new_group`) is awaited with the HTTP
    server up, before the scheduler starts and the consumer joins its group."""
    settings.require("pg_dsn", "kafka_bootstrap_servers")
    # (a delivery allocates dozens of short-lived objects: with the default thresholds
    # collections took ~13% of the event loop's CPU, docs/performance.md)
    collector.for_bulk_work()
    registry = CollectorRegistry()
    liveness = Liveness()
    engine = EngineClient.from_settings(settings)
    dsn = settings.pg_dsn.get_secret_value()
    lot = ParkingLot(dsn)  # the admin API's and the scheduler's
    # The consumer's parks: a flood of bad input is many batches at once, each queued
    # behind the ones before it (each bounded) - a long queue of our own is not "busy".
    park_lot = ParkingLot(dsn, timeouts=LotTimeouts(queue_s=None))
    retrier = Retrier(lot=lot, engine=engine, settings=settings)
    sink = Sink(settings, engine=engine, lot=park_lot, registry=registry, liveness=liveness)
    stop = asyncio.Event()
    scheduler = Scheduler(
        retrier, interval_s=settings.scheduler_interval_s, enabled=settings.scheduler_enabled
    )
    app = create_app(
        lot=lot,
        retrier=retrier,
        token=settings.admin_api_token.get_secret_value(),
        registry=registry,
        liveness=liveness,
        max_body_bytes=settings.admin_api_max_body_bytes,
    )
    web = (
        app
        if mount is None
        else mount(
            app, settings=settings, lot=lot, retrier=retrier, registry=registry, liveness=liveness
        )
    )
    server = uvicorn.Server(
        uvicorn.Config(
            web,
            host=settings.http_host,
            port=settings.sink_http_port,
            log_config=None,  # propagate to the root handler: text or JSON, like every line
            log_level=None,  # the root logger's level (LOG_LEVEL) decides
            access_log=False,
            lifespan="off",
            # h11 bounds the request line + headers (400 above it); httptools does not.
            http="h11",
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    )
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, _stopper(sink, stop, sig))
    tasks = [asyncio.create_task(server.serve(), name="http")]
    try:
        if admit is None or await admit(settings, liveness, stop):
            tasks.append(asyncio.create_task(scheduler.run(stop), name="scheduler"))
            await sink.run()
    finally:
        stop.set()
        server.should_exit = True
        _done, pending = await asyncio.wait(tasks, timeout=SERVICE_STOP_S)
        for task in pending:  # (a scheduler run mid-way: its leases expire)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.aclose()
        await lot.close()
        await park_lot.close()
    log.info(
        "sink stopped: %d delivered, %d parked",
        sink.delivered_count,
        sink.parked_count,
        extra={"state": "stopped"},
    )
    return 0


def _stopper(sink: Sink, stop: asyncio.Event, sig: signal.Signals) -> Callable[[], None]:
    def handler() -> None:
        # uvicorn hands the signal it caught back when its server ends: said once
        if not stop.is_set():
            log.info("signal %s: stopping the sink", sig.name, extra={"state": "stopping"})
        sink.stop()
        stop.set()

    return handler
