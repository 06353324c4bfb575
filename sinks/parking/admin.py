"""The sink's HTTP face: admin API (token-protected), /metrics, /healthz, /readyz.

Guarantees:

* every path but :data:`PUBLIC_PATHS` requires ``Authorization: Bearer
  <ADMIN_API_TOKEN>``, checked by :class:`~sinks.parking.guard.RequestGuard` before the
  body is read: 401 (``WWW-Authenticate: Bearer``) whatever the body, 503 when no
  token is configured; bodies are bounded (413) by the same guard;
* ``POST .../retry`` takes exactly what :class:`RetryRequest`'s schema says:
  strict JSON (no NaN/Infinity, no lone surrogates, valid UTF-8, nesting bounded)
  into a strict model (no string→int, no int→bool, ``event_ids`` non-empty unless
  ``retry_all``); a body that is not JSON is a 400, one that breaks the schema a
  422, a declared media type other than JSON a 415; error answers name the field
  and the reason and never echo the body;
* ``GET /api/v1/admin/failed-sync-events`` lists the oldest 100 FAILED/PENDING
  rows; ``POST .../retry`` answers the reference design's envelope
  ``{"success", "message", "data": {"processed_count", "done_count", "failed_count"}}``;
  failures inside a retry are counted, never a 5xx;
* no request gets a 5xx other than 503 (no token configured, or the parking lot
  cannot answer: a lock on ``failed_sync_events``, a hung or unreachable
  database - within the lot's bounded waits, :mod:`sinks.parking.lot`, never a hang);
* ``/openapi.json`` describes all of it: the bearer scheme, every status code of
  every admin operation with its body model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cdc.health import Liveness
from sinks.core.errors import SinkError
from sinks.parking.guard import (
    DEFAULT_MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    ErrorDetail,
    ErrorResponse,
    RequestGuard,
    checked_body_limit,
    error_response,
)
from sinks.parking.lot import ParkedEvent, ParkingLot, ParkingLotUnavailable
from sinks.parking.retrier import Retrier, retry_message

log = logging.getLogger("sinks.admin")

API_TITLE = "outbox-cdc sink"
API_VERSION = "0.1.0"
LIST_PATH = "/api/v1/admin/failed-sync-events"
RETRY_PATH = "/api/v1/admin/failed-sync-events/retry"
#: Served to anyone: probes, metrics and the API's own description.
PUBLIC_PATHS = frozenset(
    {"/metrics", "/healthz", "/readyz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
#: Rows the list shows (the reference design's "top 100").
LIST_LIMIT = 100
#: Largest id a retry names: ``failed_sync_events.event_id`` is a bigint identity
#: (from 1); above 2^53 - 1 a JSON number is not exact in every client (RFC 7493).
MAX_EVENT_ID = 2**53 - 1
#: Ids one retry request may name: bounds the work and the query of one request.
MAX_RETRY_IDS = 1000
#: Validation errors reported per answer: enough to fix a body, bounded for a hostile one.
MAX_ERRORS_REPORTED = 20
#: Characters of a field name quoted back in an error (an unknown key may be huge).
MAX_QUOTED_CHARS = 64
#: Name of the security scheme in the OpenAPI document.
SECURITY_SCHEME = "bearerAuth"


def _json_integer(value: object) -> object:
    """JSON has one number type: ``2.0`` *is* the integer 2 (as the schema's ``integer``
    says); anything else (strings, booleans, fractions, NaN, infinities) goes on to
    the strict ``int`` check unchanged and is refused there."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


EventId = Annotated[int, Field(ge=1, le=MAX_EVENT_ID), BeforeValidator(_json_integer)]


class RetryRequest(BaseModel):
    """Body of the retry endpoint: ids, or every open row.

    Strict: integers are JSON integers, booleans JSON booleans, no other keys.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={
            "description": (
                "Give a non-empty `event_ids`, or `retry_all: true` (up to 100 open rows)."
                " With both, only the named rows are retried."
            ),
            "anyOf": [
                {"required": ["event_ids"], "properties": {"event_ids": {"minItems": 1}}},
                {"required": ["retry_all"], "properties": {"retry_all": {"const": True}}},
            ],
        },
    )

    event_ids: list[EventId] = Field(
        default_factory=list,
        max_length=MAX_RETRY_IDS,
        description="Parking-lot row ids (`event_id`) to retry now, whatever their schedule.",
    )
    retry_all: bool = Field(
        default=False, description="Retry the oldest open rows (at most 100) when no ids are given."
    )

    @model_validator(mode="after")
    def _names_something(self) -> RetryRequest:
        if not self.event_ids and not self.retry_all:
            raise PydanticCustomError(
                "nothing_to_retry", "give a non-empty event_ids or retry_all: true"
            )
        return self


class RetryData(BaseModel):
    processed_count: int
    done_count: int
    failed_count: int


class RetryResponse(BaseModel):
    """The reference design's answer to a retry, key for key."""

    success: bool
    message: str
    data: RetryData


class ParkedEventOut(BaseModel):
    """One parking-lot row as the list shows it."""

    event_id: int
    event_type: str
    payload_json: str
    status: str
    retry_count: int
    last_error: str | None
    next_retry_at: datetime | None
    created_at: datetime
    updated_at: datetime
    outbox_event_id: str | None
    kafka_topic: str | None
    kafka_partition: int | None
    kafka_offset: int | None

    @classmethod
    def of(cls, row: ParkedEvent) -> ParkedEventOut:
        return cls.model_validate(row, from_attributes=True)


class FailedEventsData(BaseModel):
    events: list[ParkedEventOut]
    count: int


class FailedEventsResponse(BaseModel):
    success: bool
    message: str
    data: FailedEventsData


class RequestBodyError(SinkError):
    """A retry body that is not JSON (400) or breaks the schema (422)."""

    retriable = False

    def __init__(self, status_code: int, message: str, errors: Sequence[ErrorDetail]) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.errors = list(errors)


def quote(text: str, limit: int | None = MAX_QUOTED_CHARS) -> str:
    """Text fit for an answer: cut to ``limit`` characters, any lone surrogate escaped."""
    return text[:limit].encode("utf-8", "backslashreplace").decode("utf-8")


def error_details(exc: ValidationError) -> list[ErrorDetail]:
    """The first errors of a validation, without the input they refer to."""
    out = []
    for err in exc.errors(include_url=False, include_context=False, include_input=False):
        loc: list[str | int] = [p if isinstance(p, int) else quote(str(p)) for p in err["loc"]]
        out.append(ErrorDetail(loc=["body", *loc], type=err["type"], msg=quote(err["msg"], None)))
        if len(out) >= MAX_ERRORS_REPORTED:
            break
    return out


def parse_retry_request(raw: bytes) -> RetryRequest:
    """Strict JSON into the strict model; :class:`RequestBodyError` (400 or 422) otherwise."""
    try:
        return RetryRequest.model_validate_json(raw)
    except ValidationError as exc:
        details = error_details(exc)
        if any(d.type == "json_invalid" for d in details):
            raise RequestBodyError(400, "request body is not valid JSON", details) from None
        message = f"invalid retry request: {exc.error_count()} error(s)"
        raise RequestBodyError(422, message, details) from None


def is_json(content_type: str | None) -> bool:
    """``application/json`` (any parameters; a charset, if given, must be UTF-8)."""
    if content_type is None:
        return False
    media_type, *params = (part.strip().lower() for part in content_type.split(";"))
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    return media_type == "application/json" and all(c in {"utf-8", "utf8"} for c in charsets)


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
) -> FastAPI:
    """The sink's FastAPI application (OpenAPI at /docs and /openapi.json)."""
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
        summary = await retrier.retry(body.event_ids or None, retry_all=body.retry_all)
        log.info("admin retry: %s", summary.as_data())
        return RetryResponse(
            success=True,
            message=retry_message(summary.unknown_ids, summary.busy_ids),
            data=RetryData(**summary.as_data()),
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
