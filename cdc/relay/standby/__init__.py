"""Standby: waiting while another relay streams the slot, and standby-safe mode.

What it is for: :mod:`.wait` (a standby's wait for the slot), :mod:`.safe`
(standby-safe mode: stream only what a promoted standby will have), :mod:`.gate`
(its decisions, pure), :mod:`.watch` (whether the standbys carry the failover slot for
good: ``/readyz`` and a gauge). Imports: :mod:`cdc.relay.health` and the kernel.
"""
