"""sinks: deliver outbox events from Kafka to the gamification engine.

The sink is a Kafka consumer group that delivers every record to the engine's
internal HTTP API at least once, with the event id as idempotency key, and
stores an offset only when every record at or below it is delivered (2xx) or
parked. Decisions are pure; the I/O around them is thin.

Pure core:

- :mod:`sinks.errors`   - one error root; ``retriable`` / ``spends_attempt`` say
  what a loop does with each outcome;
- :mod:`sinks.routes`   - the ``type`` header -> the engine call;
- :mod:`sinks.core.retry`    - HTTP status -> outcome, backoff schedules;
- :mod:`sinks.core.delivery` - offset watermarks and per-key ordering.

I/O:

- :mod:`sinks.http1`    - a lean asyncio HTTP/1.1 keep-alive pool with TLS, mTLS and
  HTTP proxies (parsing pure, tested on bytes); measured side by side
  (tests/bench/test_transport_bench.py) it costs about half the client CPU per
  request of aiohttp's client and a tenth of httpx's, over plain HTTP and TLS;
- :mod:`sinks.engine`   - the engine's HTTP client, errors mapped at the boundary;
- :mod:`sinks.stub`     - a real HTTP engine stub with idempotency and fault injection;
- :mod:`sinks.dispatch` - one delivery (with the user sync a quiz attempt may need);
- :mod:`sinks.consumer` - the consumer loop; :mod:`sinks.parking.lot`, :mod:`sinks.parking.retrier`
  - the parking lot and its retries; :mod:`sinks.parking.admin`, :mod:`sinks.service`,
  :mod:`sinks.ops` - the process, its HTTP face and the ops commands;
- :mod:`sinks.parking.guard`    - the HTTP face's request guard: the admin token before the
  body, bounded headers and bodies (its decisions are pure functions).
"""
