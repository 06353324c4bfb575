"""The sink's pure core: its decisions, offset bookkeeping and retry policy - no I/O.

What it is for: everything the sink decides. :mod:`.machine` is the one state
machine (events in, actions out: deliver, pause, park, commit), :mod:`.delivery`
the offset watermarks and per-key ordering, :mod:`.retry` what an engine
response means and how long to wait, :mod:`.errors` the one error root of
``sinks`` (whose classes say what a loop does with each outcome). The shells
(:mod:`sinks.kafka.consumer`, :mod:`sinks.kafka.worker`) only drive them. What
it may import: the ``cdc`` kernel's constants and records; nothing else of
``sinks`` and nothing that does I/O. Invariants: an
offset is committed only after every record at or below it is delivered or
parked; records of one key start in offset order, one at a time; trouble is
judged per engine route - a route that is down holds its own records (and
their keys' later ones), spends no attempt, and never holds another route's.
"""
