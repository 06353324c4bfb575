"""The engine client: where the wire is - one POST per record, every failure classified.

What it is for: :mod:`.client` (the engine's HTTP client; errors mapped at the
boundary to :mod:`sinks.core.errors`), :mod:`.dispatch` (one delivery, with
the user sync a quiz attempt may need), :mod:`.deadlines` (the bound on each
request) and :mod:`.http1` (a lean HTTP/1.1 keep-alive pool: wire format,
response parsing, one connection, the pool, the proxy tunnel). What it may
import: the ``cdc`` kernel, :mod:`sinks.core` and :mod:`sinks.shared`; never
Kafka, the parking lot or the command line. Invariants: every request carries
the event id as ``Idempotency-Key`` and has a deadline; every answer that is
not a 2xx is one :class:`~sinks.core.errors.SinkError` whose class says what a
loop does with it.
"""
