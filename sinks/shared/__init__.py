"""What the engine client, the Kafka shell, the parking lot and the stub all use.

What it is for: :mod:`.routes` (the ``type`` header -> the engine call, the one
route catalogue the sink and the stub share), :mod:`.tracing` (a Kafka
record's trace context carried to the engine call) and :mod:`.logs` (log lines
and metric labels that stay bounded under input other teams control). What it
may import: the ``cdc`` kernel and :mod:`sinks.core` (the record, the error
root); nothing that delivers, consumes or parks. Invariants: a route is found
by the record's type alone, the same in the sink and the stub; a log line or a
metric label never grows with the number of distinct values it names.
"""
