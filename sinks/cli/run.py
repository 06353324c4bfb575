"""Commands that run the sink side: ``sink``, ``engine-stub``, ``demo``.

Each parses its options, builds settings and calls one library function
(:func:`sinks.runtime.service.run_sink`, :func:`sinks.stub.run_stub`,
:func:`sinks.cli.demo.run_demo`).
"""

from __future__ import annotations

import logging
import sys

import click

from cdc.cli import interrupt
from cdc.cli.app import load_settings, require_free_port, settings_line

#: The variables the sink process reads (its start line shows those set to other than
#: their defaults): the connections, the topics it subscribes to, its own, the engine
#: client's, the parking lot's, the admin API's and the console's, logging. Not the
#: relay's own, nor the engine stub's.
SINK_SETTINGS = (
    "CDC_PG_DSN",
    "KAFKA_BOOTSTRAP_SERVERS",
    "KAFKA_CONFIG_",
    "CDC_HTTP_HOST",
    "CDC_TOPIC_PREFIX",
    "CDC_DLQ_TOPIC",
    "CDC_CHECKPOINT_TOPIC",
    "SINK_",
    "ENGINE_",
    "INTERNAL_API_KEY",
    "HTTPS_PROXY",
    "HTTP_PROXY",
    "NO_PROXY",
    "ADMIN_API_",
    "CONSOLE_",
    "OUTBOX_SCHEDULER_",
    "OUTBOX_RETRY_",
    "LOG_",
)


def sink_reads(variable: str) -> bool:
    """The sink reads ``variable`` (the engine stub's ``ENGINE_STUB_*`` it does not)."""
    return variable.startswith(SINK_SETTINGS) and not variable.startswith("ENGINE_STUB_")


@click.command()
def sink() -> None:
    """Deliver outbox events from Kafka to the engine (consumer group; runs until SIGTERM)."""
    import asyncio

    from sinks.console.app import mount_console
    from sinks.ops.new_group import guard_new_group
    from sinks.runtime.service import run_sink

    settings = load_settings("pg_dsn", "kafka_bootstrap_servers")
    require_free_port(settings, "sink_http_port")
    interrupt.release()  # the sink's shutdown is its own: finish in-flight, commit
    logging.getLogger("sinks").info(
        "sink starting with %s",
        settings_line(settings, reads=sink_reads),
        extra={"state": "starting"},
    )
    sys.exit(asyncio.run(run_sink(settings, admit=guard_new_group, mount=mount_console)))


@click.command("engine-stub")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@click.option("--port", type=int, default=None, help="port (default ENGINE_STUB_PORT, 8081)")
@click.option(
    "--latency-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="fixed latency added to every engine request",
)
def engine_stub(host: str, port: int | None, latency_ms: float) -> None:
    """Run the engine stub: a real HTTP server standing in for the engine.

    HTTPS with ENGINE_STUB_TLS_CERT and ENGINE_STUB_TLS_KEY; client certificates
    signed by ENGINE_STUB_CLIENT_CA required when that is set too.
    """
    from sinks.stub.server import StubTLS, run_stub

    settings = load_settings()
    interrupt.release()  # uvicorn handles SIGINT/SIGTERM itself
    tls = None
    if settings.engine_stub_tls_cert or settings.engine_stub_tls_key:
        settings.require("engine_stub_tls_cert", "engine_stub_tls_key")
        tls = StubTLS(
            certfile=settings.engine_stub_tls_cert,
            keyfile=settings.engine_stub_tls_key,
            client_ca=settings.engine_stub_client_ca,
        )
    if port is None:
        require_free_port(settings.model_copy(update={"http_host": host}), "engine_stub_port")
    run_stub(
        host=host,
        port=port or settings.engine_stub_port,
        api_key=settings.internal_api_key.get_secret_value(),
        latency_ms=latency_ms,
        tls=tls,
    )


@click.group(invoke_without_command=True)
@click.option("--users", type=int, default=500, show_default=True, help="users to register")
@click.option(
    "--attempts-per-user", type=int, default=5, show_default=True, help="quiz attempts per user"
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    default=".dev",
    show_default=True,
    help="where the children's logs go",
)
@click.option(
    "--keep-running",
    is_flag=True,
    help="leave relay, sink and stub running afterwards (as make run does; make stop ends them)",
)
@click.pass_context
def demo(
    ctx: click.Context, users: int, attempts_per_user: int, log_dir: str, keep_running: bool
) -> None:
    """Run the whole pipeline on the local stack with a burst of events and a summary.

    Day two: `demo start` (make run) leaves it running, `demo write` writes into it,
    `demo stop` (make stop) ends it.
    """
    if ctx.invoked_subcommand is not None:
        return
    from pathlib import Path

    from sinks.cli.demo import run_demo

    run_demo(
        users=users,
        attempts_per_user=attempts_per_user,
        log_dir=Path(log_dir),
        keep_running=keep_running,
    )


@demo.command("start")
def demo_start() -> None:
    """Start engine stub, relay and sink in the background on the stack (make run).

    PIDs, ports and logs go to .dev/run (OUTBOX_DEV_DIR/run); `demo stop` ends them.
    """
    from sinks.cli.demo import start_background
    from sinks.cli.runfiles import run_dir

    for line in start_background(where=run_dir()):
        click.echo(line)


@demo.command("stop")
def demo_stop() -> None:
    """Stop what `demo start` (or `demo --keep-running`) left running (make stop)."""
    from sinks.cli.runfiles import run_dir, stop_background

    for line in stop_background(where=run_dir()):
        click.echo(line)


@demo.command("write")
@click.option("--users", type=int, default=100, show_default=True, help="users to register")
@click.option(
    "--attempts-per-user", type=int, default=2, show_default=True, help="quiz attempts per user"
)
def demo_write(users: int, attempts_per_user: int) -> None:
    """Commit a burst of registrations and quiz attempts into the running pipeline.

    Followed until the engine stub applied every event, when a stub answers.
    """
    from sinks.cli.demo import write_burst

    for line in write_burst(users=users, attempts_per_user=attempts_per_user):
        click.echo(line)
