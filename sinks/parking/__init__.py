"""The parking lot: records the engine would not take, kept in PostgreSQL and retried.

What it is for: :mod:`.lot` (table ``failed_sync_events``), :mod:`.claims` (who
may retry a row and what an attempt does, as a pure, model-checked state
machine), :mod:`.retrier` (the retries shared by the scheduler, the admin API
(:mod:`sinks.http`) and the CLI) and :mod:`.statements` (its batch write). What
it may import: the kernel, :mod:`sinks.core`, the engine client and
:mod:`sinks.engine.dispatch`; never the consumer loop or the command line.
Invariants: a parked record is never lost and never retried by two instances
at once (a claim with a lease); an engine outage spends no attempt, a
rejection does.
"""
