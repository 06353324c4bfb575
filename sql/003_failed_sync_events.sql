-- The sink's parking lot, with the fields of the reference design plus where
-- the event came from. One row per event: outbox_event_id (the idempotency
-- key) is unique, so a redelivered event never makes a second row.
CREATE TABLE IF NOT EXISTS failed_sync_events (
    event_id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- USER_SYNC, QUIZ_SYNC; UNROUTABLE for an event type the sink has no route for
    event_type       text        NOT NULL
                     CHECK (event_type IN ('USER_SYNC', 'QUIZ_SYNC', 'UNROUTABLE')),
    -- the record value as received (text: a malformed payload is parked too)
    payload_json     text        NOT NULL,
    status           text        NOT NULL DEFAULT 'FAILED'
                     CHECK (status IN ('FAILED', 'PENDING', 'DONE')),
    retry_count      integer     NOT NULL DEFAULT 0,
    last_error       text        NULL,
    next_retry_at    timestamptz NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    outbox_event_id  uuid        NULL UNIQUE,
    kafka_topic      text        NULL,
    kafka_partition  integer     NULL,
    kafka_offset     bigint      NULL,
    -- the record's key and headers, so a retry sends exactly what Kafka held
    kafka_key        text        NULL,
    kafka_headers    jsonb       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX IF NOT EXISTS failed_sync_events_due_idx
    ON failed_sync_events (next_retry_at)
    WHERE status IN ('FAILED', 'PENDING');
