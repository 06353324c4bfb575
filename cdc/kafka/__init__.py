"""Kafka, as the relay, the audit and the commands use it: the producer's configuration and
topics, the few client calls librdkafka gets wrong, and its errors and log lines.

What it is for: :mod:`.producer` (the producer's configuration, ``TopicManager``, the
delivery reports), :mod:`.client` (committed offsets without the AdminClient call that
crashes librdkafka; a command's first contact with the brokers), :mod:`.log`
(librdkafka's errors and log lines, rate-limited; ``KafkaReach``: whether a client
reaches a broker). Guarantees: nothing here imports the relay, the audit or the sink;
no secret in a log line.
"""
