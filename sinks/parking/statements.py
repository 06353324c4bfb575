"""The parking lot's write statement (:meth:`sinks.parking.lot.ParkingLot.park_many`) and
the narrowing filters of its list (``list_rows``).

One statement for a whole batch: the rows come as one ``jsonb`` document read by
``jsonb_to_recordset``; a row with an event id is unique by it, a row without one by
the record's place in Kafka (migration 008).
"""

from __future__ import annotations

from sinks.parking.reasons import REASON_CLASS_SQL

#: More filters of list_rows: the key, a text in last_error (why parked), a reason class
#: (exactly, :data:`~sinks.parking.reasons.REASON_CLASS_SQL`), created since/until.
LIST_NARROWING = (
    " AND (%(key)s::text IS NULL OR kafka_key = %(key)s)"
    " AND (%(reason)s::text IS NULL OR strpos(coalesce(last_error, ''), %(reason)s) > 0)"
    f" AND (%(reason_class)s::text IS NULL OR {REASON_CLASS_SQL} = %(reason_class)s)"
    " AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s)"
    " AND (%(until)s::timestamptz IS NULL OR created_at < %(until)s)"
)

#: One statement, two inserts: a row with an event id is unique by it (a redelivered or
#: replayed event refreshes its row); a row without one by the record's place in Kafka
#: (re-reading the same record finds its row - and leaves its status alone: an
#: operator's decision about it stands).
PARK_SQL = """
WITH r AS (
    SELECT * FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(sync_type text, payload text, attempts int, reason text, retry_in_s float8,
          outbox_event_id uuid, topic text, kafka_partition int, kafka_offset bigint,
          kafka_key text, headers jsonb, fingerprint text)
), keyed AS (
    INSERT INTO failed_sync_events
        (event_type, payload_json, status, retry_count, last_error, next_retry_at,
         outbox_event_id, kafka_topic, kafka_partition, kafka_offset, kafka_key, kafka_headers,
         routes_fingerprint)
    SELECT r.sync_type, r.payload, 'FAILED', r.attempts, r.reason,
           COALESCE(%(now)s::timestamptz, now()) + make_interval(secs => r.retry_in_s),
           r.outbox_event_id, r.topic, r.kafka_partition, r.kafka_offset, r.kafka_key, r.headers,
           r.fingerprint
    FROM r WHERE r.outbox_event_id IS NOT NULL
    ON CONFLICT (outbox_event_id) DO UPDATE SET
        status = 'FAILED', last_error = EXCLUDED.last_error,
        retry_count = failed_sync_events.retry_count + EXCLUDED.retry_count,
        next_retry_at = EXCLUDED.next_retry_at, updated_at = now(),
        claimed_by = NULL, claimed_until = NULL, routes_fingerprint = EXCLUDED.routes_fingerprint,
        kafka_topic = EXCLUDED.kafka_topic, kafka_partition = EXCLUDED.kafka_partition,
        kafka_offset = EXCLUDED.kafka_offset
    RETURNING event_id
), keyless AS (
    INSERT INTO failed_sync_events
        (event_type, payload_json, status, retry_count, last_error, next_retry_at,
         outbox_event_id, kafka_topic, kafka_partition, kafka_offset, kafka_key, kafka_headers,
         routes_fingerprint)
    SELECT r.sync_type, r.payload, 'FAILED', r.attempts, r.reason,
           COALESCE(%(now)s::timestamptz, now()) + make_interval(secs => r.retry_in_s),
           NULL, r.topic, r.kafka_partition, r.kafka_offset, r.kafka_key, r.headers,
           r.fingerprint
    FROM r WHERE r.outbox_event_id IS NULL
    ON CONFLICT (kafka_topic, kafka_partition, kafka_offset) WHERE outbox_event_id IS NULL
    DO UPDATE SET last_error = EXCLUDED.last_error, updated_at = now()
    RETURNING event_id
)
SELECT event_id FROM keyed UNION ALL SELECT event_id FROM keyless
"""
