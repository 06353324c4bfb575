"""The Kafka shell: the consumer group member, its Kafka thread, the process.

What it is for: :mod:`.consumer` (the asyncio loop that carries out what
:class:`sinks.core.machine.SinkCore` decides), :mod:`.worker` (librdkafka on
a thread of its own), :mod:`.config` (its Kafka settings), :mod:`.metrics`
(its ``outbox_sink_*`` series), :mod:`.offset_expiry` (offsets that retention removed:
never skipped silently) and :mod:`.service` (the ``outbox-cdc sink`` process:
the consumer, the parking lot's retrier and the admin API). What it may
import: everything below it - the ``cdc`` kernel, :mod:`sinks.core`,
:mod:`sinks.shared`, :mod:`sinks.engine`, :mod:`sinks.parking`; never the
command line or the group operations. Invariants: no Kafka call blocks a
delivery, the admin API or the scheduler; an offset is stored only when the
core says every record at or below it is delivered or parked.
"""
