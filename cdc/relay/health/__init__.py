"""Health: what the relay says about itself - its state, metrics, and the watches behind them.

What it is for: :mod:`.state` (the relay's state and ``/readyz``), :mod:`.metrics`,
:mod:`.silence` (pure: a silent stream told from an idle one) and
:mod:`.silent_session` (acting on it), :mod:`.stall` and :mod:`.kafka_ready` (whether
Kafka takes records), :mod:`.monitor` (the slot gauges and heartbeat thread). The
bottom of the relay: it imports nothing of :mod:`cdc.relay` outside it.
"""
