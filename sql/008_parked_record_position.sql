-- A parked record without an event id (no `id` header, or one that holds no uuid) is
-- found again by where it sits in Kafka: re-reading the same record (a replay, a
-- rebalance before the commit) refreshes its row instead of parking another one
-- (sinks/parking/lot.py). Rows with an id stay unique by outbox_event_id.
--
-- Copies of one record parked before this rule are one record: the oldest row is
-- kept, the later copies (the same Kafka bytes) are removed.
DELETE FROM failed_sync_events later
USING failed_sync_events first
WHERE later.outbox_event_id IS NULL AND first.outbox_event_id IS NULL
  AND later.kafka_topic = first.kafka_topic
  AND later.kafka_partition = first.kafka_partition
  AND later.kafka_offset = first.kafka_offset
  AND later.event_id > first.event_id;

CREATE UNIQUE INDEX IF NOT EXISTS failed_sync_events_keyless_position_idx
    ON failed_sync_events (kafka_topic, kafka_partition, kafka_offset)
    WHERE outbox_event_id IS NULL;
