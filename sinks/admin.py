"""The sink's HTTP face: admin API (token-protected), /metrics, /healthz, /readyz.

Guarantees:

* every ``/api/v1/admin/*`` route requires ``Authorization: Bearer <ADMIN_API_TOKEN>``
  (or ``X-Admin-Token``), compared in constant time; with no token configured
  the admin API refuses everything (503) rather than running open;
* malformed bodies get 422 with the validation errors; unknown ids are
  reported in the answer; failures inside a retry are counted, never a 500;
* ``GET /api/v1/admin/failed-sync-events`` lists the oldest 100 FAILED/PENDING
  rows; ``POST .../retry`` answers the reference design's envelope
  ``{"success", "message", "data": {"processed_count", "done_count", "failed_count"}}``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from cdc.health import Liveness
from sinks.parking import ParkingLot
from sinks.retrier import Retrier

log = logging.getLogger(__name__)


class RetryRequest(BaseModel):
    """Body of the retry endpoint: ids, or every open row."""

    model_config = ConfigDict(extra="forbid")
    event_ids: list[int] = Field(default_factory=list)
    retry_all: bool = False


class RetryData(BaseModel):
    processed_count: int
    done_count: int
    failed_count: int


class RetryResponse(BaseModel):
    success: bool
    message: str
    data: RetryData


def _token_guard(token: str) -> Any:
    async def guard(
        authorization: Annotated[str | None, Header()] = None,
        x_admin_token: Annotated[str | None, Header()] = None,
    ) -> None:
        if not token:
            raise HTTPException(503, "admin API disabled: set ADMIN_API_TOKEN")
        given = x_admin_token or ""
        if authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(
                401, "missing or wrong admin token", headers={"WWW-Authenticate": "Bearer"}
            )

    return guard


def create_app(
    *,
    lot: ParkingLot,
    retrier: Retrier,
    token: str,
    registry: CollectorRegistry,
    liveness: Liveness,
) -> FastAPI:
    """The sink's FastAPI application (OpenAPI at /docs and /openapi.json)."""
    app = FastAPI(title="outbox-cdc sink", version="0.1.0")
    admin = [Depends(_token_guard(token))]

    @app.get("/api/v1/admin/failed-sync-events", dependencies=admin)
    async def list_failed() -> dict[str, Any]:
        rows = await lot.list_open(100)
        return {
            "success": True,
            "message": f"{len(rows)} failed or pending sync events",
            "data": {"events": [r.as_json() for r in rows], "count": len(rows)},
        }

    @app.post(
        "/api/v1/admin/failed-sync-events/retry", dependencies=admin, response_model=RetryResponse
    )
    async def retry_failed(body: RetryRequest) -> RetryResponse | JSONResponse:
        if not body.event_ids and not body.retry_all:
            return JSONResponse(
                status_code=422,
                content={
                    "success": False,
                    "message": "give event_ids or retry_all: true",
                    "data": {"processed_count": 0, "done_count": 0, "failed_count": 0},
                },
            )
        summary = await retrier.retry(body.event_ids or None, retry_all=body.retry_all)
        log.info("admin retry: %s", summary.as_data())
        return RetryResponse(
            success=True, message=summary.message, data=RetryData(**summary.as_data())
        )

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

    return app
