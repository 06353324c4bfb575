"""sinks: deliver outbox events from Kafka to the gamification engine.

The sink is a Kafka consumer group that delivers every record to the engine's
internal HTTP API at least once, with the event id as idempotency key, and
stores an offset only when every record at or below it is delivered (2xx) or
parked. This package keeps the decisions pure and the I/O thin:

- :mod:`sinks.errors`   - one error root; ``retriable`` / ``spends_attempt`` say
  what a loop does with each outcome;
- :mod:`sinks.routes`   - the ``type`` header -> the engine call (pure);
- :mod:`sinks.retry`    - HTTP status -> outcome, backoff schedules (pure);
- :mod:`sinks.delivery` - offset watermarks and per-key ordering (pure);
- :mod:`sinks.engine`   - the engine's HTTP client (httpx), errors mapped at the boundary;
- :mod:`sinks.stub`     - a real HTTP engine stub with idempotency and fault injection.
"""
