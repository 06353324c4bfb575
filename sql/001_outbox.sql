-- The outbox: one row per event, written in the same transaction as the
-- business change. Debezium outbox-router compatible columns. The relay reads
-- inserts from the WAL, never from this table, so rows may be deleted at any
-- time after commit (see `outbox-cdc prune` and the delete-in-same-tx mode).
CREATE TABLE IF NOT EXISTS outbox (
    id                 uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    aggregatetype      text        NOT NULL,
    aggregateid        text        NOT NULL,
    type               text        NOT NULL,
    payload            jsonb       NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    tracingspancontext text        NULL
);

CREATE INDEX IF NOT EXISTS outbox_created_at_idx ON outbox (created_at);

-- Only inserts are published: updates/deletes of the outbox are housekeeping.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_pub') THEN
        CREATE PUBLICATION outbox_pub FOR TABLE outbox WITH (publish = 'insert');
    END IF;
END
$$;
