"""The sink process's shell: the loop around the core, what it makes of answers, the process.

What it is for: :mod:`.sink` (the asyncio loop that carries out what
:class:`sinks.core.machine.SinkCore` decides: sends, parks, commits, pauses),
:mod:`.verdicts` (a record's routing verdict and an engine answer's meaning, for the
core; pure), :mod:`.parks` (park batches written to the parking lot),
:mod:`.readiness` (what ``/readyz`` says, one log line per change), :mod:`.metrics`
(every ``outbox_sink_*`` series) and :mod:`.service` (the ``outbox-cdc sink``
process: the consumer, the parking lot's scheduler, the HTTP server).

What it may import: everything below it - the ``cdc`` kernel, :mod:`sinks.core`,
:mod:`sinks.shared`, :mod:`sinks.engine`, :mod:`sinks.parking`, :mod:`sinks.kafka`
(the consumer's thread) and :mod:`sinks.http` (the process's endpoints); never the
command line or the group operations.

Invariants: every decision is the core's (this folder carries them out and reports
what came of them); no Kafka call blocks a delivery, the admin API or the scheduler;
an offset is committed only when the core says every record at or below it is
delivered or parked; SIGTERM ends within ``SINK_SHUTDOWN_S``.
"""
