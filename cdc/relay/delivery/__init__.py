"""Delivery modes: what exactly-once adds to the at-least-once stream.

What it is for: :mod:`.exactly_once` (the exactly-once delivery mode, its admission
rule, and the relay that runs it), :mod:`.txbatch` (the pure transaction machine:
which WAL transactions one Kafka transaction holds, what it admits; model-checked),
:mod:`.eos_steps` and :mod:`.overlap` (the machine's steps on the stream; committing
one Kafka transaction while the next fills), :mod:`.checkpoint` (the checkpoint record
the relay can prove), :mod:`.epoch` (the producer's fencing epoch), :mod:`.eos_start`
(where a start resumes). The top of the relay: it imports :mod:`cdc.relay.stream` and
below, nothing imports it but the command line.
"""
