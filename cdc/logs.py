"""Logging set-up shared by every process: one line per event, text or JSON.

``LOG_LEVEL`` (default INFO) and ``LOG_FORMAT`` (``text`` | ``json``) choose the
output. Nothing here formats settings: callers log ``Settings.safe_summary()``,
never a DSN or a key.

Structured fields: a call passes them as ``extra={"event_id": ..., "topic": ...,
"partition": ..., "offset": ..., "lsn": ..., "state": ...}``; the JSON format
writes every such field as a key of its own next to ``msg`` (the text format
shows the message only, which already names the object).

Every line of the process goes through the one root handler, in the one
format: uvicorn's (the HTTP servers are built with ``log_config=None``, so
its loggers propagate here) and librdkafka's (:mod:`cdc.kafka.log` routes them
to the ``kafka.<client>`` loggers) included. Every JSON line is one object.
uvicorn's general logger is named ``uvicorn.error`` for historical reasons
although it logs "Started server process" at INFO: its lines are shown under
``uvicorn`` (:data:`_RENAMED_LOGGERS`), so no healthy start reads as an error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


#: Logger names shown under another name: what the line is about, not a misnomer.
_RENAMED_LOGGERS = {"uvicorn.error": "uvicorn"}


def _rename(record: logging.LogRecord) -> bool:
    """A handler filter: the record shown under its :data:`_RENAMED_LOGGERS` name."""
    record.name = _RENAMED_LOGGERS.get(record.name, record.name)
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the ``extra`` fields (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger once, to stderr."""
    level = (level or os.environ.get("LOG_LEVEL", "INFO")).upper()
    fmt = fmt or os.environ.get("LOG_FORMAT", "text")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    handler.addFilter(_rename)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # an earlier uvicorn dictConfig may have given them handlers of their own
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
