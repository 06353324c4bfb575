"""The parking lot's admin API: list the open rows, retry rows now.

Guarantees:

* ``GET /api/v1/admin/failed-sync-events`` lists the oldest :data:`LIST_LIMIT`
  FAILED/PENDING rows; ``POST .../retry`` answers the reference design's envelope
  ``{"success", "message", "data": {"processed_count", "done_count", "failed_count"}}``;
  failures inside a retry are counted, never a 5xx;
* a retry request starts no row after :data:`RETRY_DEADLINE_S`: up to 1,000 rows'
  engine calls never run inside one HTTP request (the answer names the rows not
  tried: ask again);
* the bodies are checked as :mod:`sinks.http.schema` says; the token, by the
  guard the application puts in front (:mod:`sinks.http.app`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sinks.http.guard import MAX_HEADER_BYTES, MAX_HEADER_COUNT, ErrorResponse, error_response
from sinks.http.schema import (
    FailedEventsData,
    FailedEventsResponse,
    ParkedEventOut,
    RequestBodyError,
    RetryData,
    RetryResponse,
    is_json,
    parse_retry_request,
)
from sinks.parking.lot import ParkingLot
from sinks.parking.retrier import Retrier, retry_message

log = logging.getLogger("sinks.admin")  # the name operators filter on: kept across moves

LIST_PATH = "/api/v1/admin/failed-sync-events"
RETRY_PATH = "/api/v1/admin/failed-sync-events/retry"
#: Rows the list shows (the reference design's "top 100").
LIST_LIMIT = 100
#: A retry request starts no row after this long: up to 1,000 rows' engine calls never
#: run inside one HTTP request (the answer names the rows not tried: ask again).
RETRY_DEADLINE_S = 20.0
#: Name of the security scheme in the OpenAPI document.
SECURITY_SCHEME = "bearerAuth"


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    described = {
        400: (
            "The body is not JSON (syntax, encoding, nesting deeper than 200). The server"
            " itself answers a malformed request, or a header section that has not ended"
            f" within {MAX_HEADER_BYTES} bytes, with a plain-text 400."
        ),
        401: "No valid `Authorization: Bearer` token; the body was not read.",
        413: "The body is larger than `ADMIN_API_MAX_BODY_BYTES`.",
        415: "The body is not declared `application/json` (UTF-8).",
        422: "The body breaks the request schema.",
        431: (
            f"The header section is larger than {MAX_HEADER_BYTES} bytes"
            f" or has more than {MAX_HEADER_COUNT} fields."
        ),
        503: (
            "No `ADMIN_API_TOKEN` is configured, or the parking lot cannot answer now"
            " (a lock on failed_sync_events, a database that is down or hangs)."
        ),
    }
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorResponse, "description": described[code]}
        if code == 401:
            out[code]["headers"] = {
                "WWW-Authenticate": {
                    "description": "The bearer challenge.",
                    "schema": {"type": "string"},
                }
            }
    return out


_SECURED: dict[str, Any] = {"security": [{SECURITY_SCHEME: []}]}
_RETRY_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RetryRequest"}}},
    }
}


def add_admin_routes(
    app: FastAPI, *, lot: ParkingLot, retrier: Retrier, retry_deadline_s: float
) -> None:
    """The admin API's two operations, on ``app``."""

    @app.get(
        LIST_PATH,
        response_model=FailedEventsResponse,
        responses=_responses(401, 413, 431, 503),
        openapi_extra=_SECURED,
    )
    async def list_failed() -> FailedEventsResponse:
        """The oldest 100 FAILED or PENDING parking-lot rows."""
        rows = await lot.list_open(LIST_LIMIT)
        return FailedEventsResponse(
            success=True,
            message=f"{len(rows)} failed or pending sync events",
            data=FailedEventsData(events=[ParkedEventOut.of(r) for r in rows], count=len(rows)),
        )

    @app.post(
        RETRY_PATH,
        response_model=RetryResponse,
        responses=_responses(400, 401, 413, 415, 422, 431, 503),
        openapi_extra={**_SECURED, **_RETRY_BODY},
    )
    async def retry_failed(request: Request) -> RetryResponse | JSONResponse:
        """Retry the named rows, or (`retry_all`) the oldest 100 open rows, now."""
        if not is_json(request.headers.get("content-type")):
            return error_response(415, "send the body as Content-Type: application/json")
        try:
            body = parse_retry_request(await request.body())
        except RequestBodyError as exc:
            return error_response(exc.status_code, exc.reason, exc.errors)
        summary = await retrier.retry(
            body.event_ids or None, retry_all=body.retry_all, deadline_s=retry_deadline_s
        )
        log.info("admin retry: %s", summary.as_data())
        return RetryResponse(
            success=True,
            message=retry_message(
                summary.unknown_ids,
                summary.busy_ids,
                untried_ids=summary.untried_ids,
                deadline_s=retry_deadline_s,
            ),
            data=RetryData(**summary.as_data()),
        )
