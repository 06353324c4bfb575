"""The engine stub: a real HTTP server standing in for the gamification engine.

What it is for: the sink's tests, benchmarks and demo need an engine that
keeps the real one's contract and can fail on purpose. :mod:`.engine` holds
what the engine knows and its rules (idempotency per ``Idempotency-Key``,
``404 user_not_found`` for a quiz attempt of an unknown user, the API key),
:mod:`.faults` the injected failures (status sequences per path or event id,
extra headers, latency), :mod:`.app` the Starlette routes of the engine
endpoints and the ``/_stub`` control API, :mod:`.server` uvicorn (its public
API), outage windows that really close the listening socket, TLS and the
:class:`~sinks.stub.server.StubServer` test helper, :mod:`.connections` the open
connections (``reset_after_response``). What it may import:
:mod:`sinks.shared.routes` (the engine's paths), Starlette, uvicorn, httpx; nothing of
the sink's delivery. Invariants: the idempotency and ``user_not_found`` rules
are the stub's own, pure, in :mod:`.engine`; every answer is JSON; state lives
on the server's event loop only.
"""
