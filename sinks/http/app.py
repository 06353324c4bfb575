"""The sink's HTTP server application: one function builds it, with every route it serves.

:func:`create_app` assembles the process's endpoints - the probes and metrics
(:mod:`.probes`), the parking lot's admin API (:mod:`.admin`) - behind the request
guard (:mod:`.guard`), and any ``extra_routes`` a caller adds (a ``Mount`` of
another ASGI app at its own prefix - an operator console at ``/console/`` -
is one item of that list). Guarantees:

* every path but :data:`PUBLIC_PATHS` requires ``Authorization: Bearer
  <ADMIN_API_TOKEN>``, checked by :class:`~sinks.http.guard.RequestGuard` before the
  body is read: 401 (``WWW-Authenticate: Bearer``) whatever the body, 503 when no
  token is configured; bodies are bounded (413) by the same guard - extra routes
  included;
* no request gets a 5xx other than 503 (no token configured, or the parking lot
  cannot answer: a lock on ``failed_sync_events``, a hung or unreachable
  database - within the lot's bounded waits, :mod:`sinks.parking.lot`, never a hang);
  every error answer is the reference envelope;
* ``/openapi.json`` describes the admin API: the bearer scheme, every status code of
  every operation with its body model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from cdc.health import Liveness
from sinks.http.admin import RETRY_DEADLINE_S, SECURITY_SCHEME, add_admin_routes
from sinks.http.guard import (
    DEFAULT_MAX_BODY_BYTES,
    RequestGuard,
    checked_body_limit,
    error_response,
)
from sinks.http.probes import PROBE_PATHS, add_probes
from sinks.http.schema import RetryRequest
from sinks.parking.lot import ParkingLot, ParkingLotUnavailable
from sinks.parking.retrier import Retrier

log = logging.getLogger("sinks.admin")  # the name operators filter on: kept across moves

API_TITLE = "outbox-cdc sink"
API_VERSION = "0.1.0"
#: Served to anyone: probes, metrics and the API's own description.
PUBLIC_PATHS = PROBE_PATHS | {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The document FastAPI builds, plus the bearer scheme and the manual request body."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = doc.setdefault("components", {})
            components["securitySchemes"] = {
                SECURITY_SCHEME: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "The value of ADMIN_API_TOKEN.",
                }
            }
            components.setdefault("schemas", {})["RetryRequest"] = RetryRequest.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            app.openapi_schema = doc
        return app.openapi_schema

    return build


def _error_handlers(app: FastAPI) -> None:
    """Errors as the reference envelope: HTTP errors as they are, the parking lot's as 503."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 (with its Allow header) and the like, in the same envelope."""
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ParkingLotUnavailable)
    async def lot_unavailable(request: Request, exc: Exception) -> JSONResponse:
        """A lock on the table, a hung or unreachable database: 503 within the lot's bounds."""
        log.warning("admin request %s %s failed: %s", request.method, request.url.path, exc)
        return error_response(503, str(exc))

    @app.exception_handler(psycopg.OperationalError)
    async def database_unreachable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("admin request failed: database unreachable: %s", type(exc).__name__)
        return error_response(503, "parking lot unavailable: database unreachable")


def create_app(
    *,
    lot: ParkingLot,
    retrier: Retrier,
    token: str,
    registry: CollectorRegistry,
    liveness: Liveness,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_deadline_s: float = RETRY_DEADLINE_S,
    extra_routes: Sequence[BaseRoute] = (),
) -> FastAPI:
    """The sink's FastAPI application (OpenAPI at /docs and /openapi.json).

    ``retry_deadline_s``: a retry request starts no row after this long (it answers
    within it and one row's retry: a few engine requests, each bounded).
    ``extra_routes``: served too, behind the same guard (e.g.
    ``[Mount("/console", console_app)]``)."""
    app = FastAPI(
        title=API_TITLE,
        version=API_VERSION,
        description=(
            "Parking-lot admin API of the outbox-cdc sink. Every operation needs"
            " `Authorization: Bearer <ADMIN_API_TOKEN>`, checked before the body is read."
        ),
    )
    # Starlette builds middleware on the first request: check the limit now, at start-up.
    app.add_middleware(
        RequestGuard,
        token=token,
        max_body_bytes=checked_body_limit(max_body_bytes),
        public_paths=PUBLIC_PATHS,
    )
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    _error_handlers(app)
    add_admin_routes(app, lot=lot, retrier=retrier, retry_deadline_s=retry_deadline_s)
    add_probes(app, registry=registry, liveness=liveness)
    app.router.routes.extend(extra_routes)
    return app
