"""Operations over a consumer group of the sink: lag, replay, redelivery, the parking lot.

What it is for: what ``outbox-cdc lag``, ``replay``, ``redeliver``, ``failed``
and ``trace`` need. The arithmetic is pure and lives in :mod:`.selection`
(durations, times, topics, commit order), :mod:`.offsets` (clamping, resume
points, lag, rates) and :mod:`.plan` (replay plans); the shells drive it:
:mod:`.kafka` (the ops' Kafka client), :mod:`.lag`, :mod:`.replay`,
:mod:`.redeliver` and :mod:`.parking` (synchronous faces of the parking lot);
:mod:`.errors` holds the ops errors (``OpsError`` and its branches).
What it may import: the ``cdc`` kernel (settings, constants, LSNs, slot
status) and the sink's delivery, engine client and parking lot; never the
command line. Invariants: read-only unless named otherwise - no offset of any
group moves except through :func:`sinks.ops.replay.apply_replay`, which commits
exactly a plan's targets and refuses while the group has members; a replay
never skips what the group has not processed unless the operator says so.
"""
