"""The sink's pure core: its decisions, offset bookkeeping and retry policy - no I/O.

What it is for: everything the sink decides. :mod:`.machine` is the one state
machine (events in, actions out: deliver, pause, park, commit), :mod:`.endpoints`
each engine endpoint's circuit and the judgment of its trouble, :mod:`.window` an
endpoint's adaptive in-flight limit, :mod:`.delivery`
the offset watermarks and per-key ordering, :mod:`.statuses` what an engine
response means, :mod:`.backoff` how long to wait before probing a down engine,
:mod:`.schedule` when a parked record is tried again, :mod:`.errors` the one error root of
``sinks`` (whose classes say what a loop does with each outcome). The shells
(:mod:`sinks.runtime.sink`, :mod:`sinks.kafka.worker`) only drive them. What
it may import: the ``cdc`` kernel's constants and records; nothing else of
``sinks`` and nothing that does I/O. Invariants: an
offset is committed only after every record at or below it is delivered or
parked; records of one key start in offset order, one at a time; trouble is
judged per engine route - a route that is down holds its own records (and
their keys' later ones), spends no attempt, and never holds another route's.
"""
