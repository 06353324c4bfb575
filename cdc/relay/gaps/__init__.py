"""Gaps: whether the slot may stream, and closing a gap from the outbox table.

What it is for: :mod:`.gap` (pure: stream, create the slot, or a gap and its cause),
:mod:`.guard` (the gap check before every session), :mod:`.start_check` (the start-up
check of what the last start published), :mod:`.recovery` (closing a gap: also
``outbox-cdc slot recover``), :mod:`.ledger` (the slot's confirm limit),
:mod:`.periodic_audit` (the relay's own audit, run on a schedule). Repairs go
through :mod:`cdc.repair`; imports: :mod:`cdc.relay.standby`, :mod:`cdc.relay.health`,
:mod:`cdc.audit`, :mod:`cdc.repair` and the kernel.
"""
