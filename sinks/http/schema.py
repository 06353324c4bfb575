"""The admin API's bodies: the retry request (strict), the answers, their errors. Pure.

Guarantees:

* ``POST .../retry`` takes exactly what :class:`RetryRequest`'s schema says:
  strict JSON (no NaN/Infinity, no lone surrogates, valid UTF-8, nesting bounded)
  into a strict model (no string->int, no int->bool, ``event_ids`` non-empty unless
  ``retry_all``); a body that is not JSON is a 400 (:class:`RequestBodyError`), one
  that breaks the schema a 422, a declared media type other than JSON a 415
  (:func:`is_json`); error answers name the field and the reason, never echo the body;
* the answers are the reference design's envelope, key for key
  (:class:`RetryResponse`, :class:`FailedEventsResponse`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from sinks.core.errors import SinkError
from sinks.http.guard import ErrorDetail
from sinks.parking.lot import ParkedEvent

#: Largest id a retry names: ``failed_sync_events.event_id`` is a bigint identity
#: (from 1); above 2^53 - 1 a JSON number is not exact in every client (RFC 7493).
MAX_EVENT_ID = 2**53 - 1
#: Ids one retry request may name: bounds the work and the query of one request.
MAX_RETRY_IDS = 1000
#: Validation errors reported per answer: enough to fix a body, bounded for a hostile one.
MAX_ERRORS_REPORTED = 20
#: Characters of a field name quoted back in an error (an unknown key may be huge).
MAX_QUOTED_CHARS = 64


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
