"""Repair: putting missing records back into Kafka from the outbox table, under the slot's lock.

What it is for: the one re-publish path (:mod:`.republish`, through the bounded
Kafka transactions of :mod:`.transactional`) that the relay's gap recovery, the
start-up check and the audit's repair all use, and the slot's locks (:mod:`.lock`:
one lock type, the recovery lock and the audit lock, hardened against a connection
lost while it is held). It sits below both the relay (:mod:`cdc.relay`) and the audit
(:mod:`cdc.audit`) so that neither imports the other to repair: the audit imports
nothing of the relay. Guarantees: a row is re-published only from what the outbox
table holds, its records marked with the origin of the republisher; one repair of a
slot at a time.
"""
