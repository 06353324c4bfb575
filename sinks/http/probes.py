"""The process's probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``. Public.

Guarantees: ``/healthz`` is 200 ``ok`` while the process's loop is alive, else 503
``stalled``; ``/readyz`` is 200 while :class:`cdc.health.Liveness` says ready, else
503 with the reason it holds (what :class:`sinks.runtime.readiness.Readiness` set);
``/metrics`` is the process's registry in Prometheus' text format. None of them
reads a body, needs a token or waits on a service.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cdc.health import Liveness

#: The probes' paths: served to anyone (the guard lets them through).
PROBE_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})


def add_probes(app: FastAPI, *, registry: CollectorRegistry, liveness: Liveness) -> None:
    """The three probes, on ``app``."""

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse(
            "ok" if liveness.alive else "stalled", status_code=200 if liveness.alive else 503
        )

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> PlainTextResponse:
        return PlainTextResponse(liveness.state, status_code=200 if liveness.ready else 503)
