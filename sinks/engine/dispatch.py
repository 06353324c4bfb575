"""One delivery of one event to the engine, shared by the consumer and retries.

Guarantees: the event's own id is the ``Idempotency-Key``; ``headers`` (the
record's trace context) go with every request of the delivery; a quiz attempt
whose user the engine does not know yet triggers a ``users/sync`` first (under
a key derived from the attempt's id, the same on every redelivery), then the
attempt is sent again once - a second ``user_not_found`` right after a successful
sync is the engine's own delay (:class:`~sinks.core.errors.EngineUnavailable` of the
attempt's route: no attempt spent). Every failure surfaces as a
:class:`sinks.core.errors.SinkError` whose class says how to treat it, and whose
``endpoint`` names the engine route of the request that failed (the user sync's
own route when that is the one): trouble is judged per route.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from sinks.core.errors import EngineUnavailable, UserNotFound
from sinks.engine.client import EngineClient
from sinks.shared.logs import RepeatLog
from sinks.shared.routes import CATALOG, EngineCall, Routing, derived_user_sync_key, user_sync_call

log = logging.getLogger("sinks.dispatch")  # the name operators filter on: kept across moves

#: "engine lacks user ...; syncing the user first": the first of each event type in full,
#: then one summary per type per minute (it was one line per event: 59 of 78 lines).
#: The process's deliveries run on one event loop; the consumer ticks and flushes it.
USER_SYNCS = RepeatLog(log, "synced the user first for", level=logging.INFO)


async def deliver(
    engine: EngineClient,
    *,
    event_type: str,
    payload: bytes | None,
    event_id: str,
    routing: Routing = CATALOG,
    headers: Mapping[str, str] | None = None,
    answered: list[str] | None = None,
    duplicates: list[str] | None = None,
) -> EngineCall:
    """Route (``routing``: the catalog unless configured) and send one event.

    Returns the call that the engine accepted. ``answered`` (when given)
    collects the engine path of every request answered 2xx, in order: which
    routes showed they work during this delivery; ``duplicates`` the path of the
    event's call when the engine answered it as a duplicate (applied before).
    """
    call = routing.route(event_type, payload)
    try:
        duplicate = await engine.send(call, event_id=event_id, headers=headers)
    except UserNotFound as exc:
        user_id = exc.user_id or call.user_id
        if not user_id:
            raise
        USER_SYNCS.event(
            event_type,
            "event %s (%s): engine lacks user %s; syncing the user first (further ones are"
            " counted, summed up once a minute)",
            event_id,
            event_type,
            user_id,
            extra={"event_id": event_id, "event_type": event_type},
        )
        sync_key = derived_user_sync_key(event_id)
        sync = user_sync_call(user_id)
        await engine.send(sync, event_id=sync_key, headers=headers)
        if answered is not None:
            answered.append(sync.path)
        try:
            duplicate = await engine.send(call, event_id=event_id, headers=headers)
        except UserNotFound as again:  # the engine took the sync and does not show it yet
            raise _not_visible_yet(call, user_id) from again
    if answered is not None:
        answered.append(call.path)
    if duplicate and duplicates is not None:
        duplicates.append(call.path)
    return call


def _not_visible_yet(call: EngineCall, user_id: str) -> EngineUnavailable:
    """``user_not_found`` right after the user's sync succeeded: the engine's own state
    (it applies syncs asynchronously, DESIGN "Sink invariants" 4), never the record's -
    trouble of the attempt's route, which spends no attempt; the record is sent again."""
    error = EngineUnavailable(
        f"user_not_found for user {user_id} right after its users/sync succeeded"
        " (the engine has not applied the sync yet)"
    )
    error.endpoint = call.path
    return error
