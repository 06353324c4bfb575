"""sinks: deliver outbox events from Kafka to the gamification engine.

The sink is a Kafka consumer group that delivers every record to the engine's
internal HTTP API at least once, with the event id as idempotency key, and
stores an offset only when every record at or below it is delivered (2xx) or
parked. Decisions are pure; the I/O around them is thin. It imports the kernel
of :mod:`cdc` (settings, constants, errors, health, slot status) and nothing of
the relay.

One folder per role, imports running downward only (the order below is from
the bottom; ``tests/unit/test_layout.py`` holds it):

- :mod:`sinks.core`     - the decision: the state machine, offset watermarks and
  per-key ordering, the retry policy, the one error root (:mod:`sinks.core.errors`:
  ``retriable`` / ``spends_attempt`` say what a loop does with each outcome);
- :mod:`sinks.shared`   - what the roles above share: the routes (``type`` header
  -> engine call), tracing, bounded logs and labels;
- :mod:`sinks.engine`   - the wire: the engine's HTTP client, one delivery
  (:mod:`sinks.engine.dispatch`), request deadlines and :mod:`sinks.engine.http1`, a
  lean asyncio HTTP/1.1 keep-alive pool with TLS, mTLS and HTTP proxies (parsing
  pure, tested on bytes); measured side by side
  (tests/bench/test_transport_bench.py) it costs about half the client CPU per
  request of aiohttp's client and a tenth of httpx's, over plain HTTP and TLS;
- :mod:`sinks.stub`     - a real HTTP engine stub with idempotency and fault injection;
- :mod:`sinks.idempotent` - the toolkit for your own consumers;
- :mod:`sinks.parking`  - the parking lot, its retries and claims;
- :mod:`sinks.http`     - the process's endpoints: probes, metrics, the admin API, its guard;
- :mod:`sinks.kafka`    - Kafka: the consumer's thread, offset expiry, the fetch watch;
- :mod:`sinks.runtime`  - the process's shell: the loop around the core, parks,
  readiness, metrics, the ``outbox-cdc sink`` process;
- :mod:`sinks.ops`, :mod:`sinks.trace` - group operations (lag, replay,
  redelivery) and "where is event X";
- :mod:`sinks.cli`      - the sink's commands of ``outbox-cdc`` (an entry point),
  the preflight's sink items and the demo.
"""
