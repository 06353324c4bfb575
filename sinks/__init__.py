"""sinks: deliver outbox events from Kafka to the gamification engine.

The sink is a Kafka consumer group that delivers every record to the engine's
internal HTTP API at least once, with the event id as idempotency key, and
stores an offset only when every record at or below it is delivered (2xx) or
parked. Decisions are pure; the I/O around them is thin. It imports the kernel
of :mod:`cdc` (settings, constants, errors, health, slot status) and nothing of
the relay.

- :mod:`sinks.core`     - the pure decisions: the state machine, offset
  watermarks and per-key ordering, the retry policy;
- :mod:`sinks.routes`   - the ``type`` header -> the engine call;
- :mod:`sinks.http1`    - a lean asyncio HTTP/1.1 keep-alive pool with TLS, mTLS and
  HTTP proxies (parsing pure, tested on bytes); measured side by side
  (tests/bench/test_transport_bench.py) it costs about half the client CPU per
  request of aiohttp's client and a tenth of httpx's, over plain HTTP and TLS;
- :mod:`sinks.engine`   - the engine's HTTP client, errors mapped at the boundary;
  :mod:`sinks.dispatch` - one delivery (with the user sync a quiz attempt may need);
- :mod:`sinks.consumer`, :mod:`sinks.kafka_worker`, :mod:`sinks.service` - the
  consumer shell, its Kafka thread, the process;
- :mod:`sinks.parking`  - the parking lot, its retries, claims, admin API and guard;
- :mod:`sinks.ops`, :mod:`sinks.trace` - group operations (lag, replay,
  redelivery) and "where is event X";
- :mod:`sinks.cli`      - the sink's commands of ``outbox-cdc`` (an entry point);
- :mod:`sinks.stub`     - a real HTTP engine stub with idempotency and fault injection;
- :mod:`sinks.errors`   - one error root; ``retriable`` / ``spends_attempt`` say
  what a loop does with each outcome.
"""
