-- The relay's record of its slot's lifetime (cdc/gaps.py): the slot it created at
-- its first start, every gap it found (a lost, dropped or failed-over slot), how
-- each gap ended (recovered from the outbox table, or the loss accepted by a named
-- operator) and what was re-published. Read by `outbox-cdc slot status`, the
-- backlog guard (an open gap is `over`) and `outbox-cdc prune` (nothing inside an
-- open gap's window is deleted).
CREATE TABLE IF NOT EXISTS outbox_cdc_slot_history (
    id                    bigserial        PRIMARY KEY,
    slot                  text             NOT NULL,
    -- 'created' (first start) or 'gap'
    event                 text             NOT NULL,
    -- gap cause (cdc.relay.gap.GapCause) or 'first_start'
    cause                 text             NOT NULL,
    detail                text             NOT NULL DEFAULT '',
    -- 'open' (unrecovered), 'recovered', 'accepted' (loss accepted), 'created'
    state                 text             NOT NULL,
    detected_at           timestamptz      NOT NULL DEFAULT now(),
    -- the newest record of the slot found in Kafka when the gap was found
    last_published_ts     timestamptz      NULL,
    last_published_origin text             NULL,
    -- outbox rows re-read: created (or committed) in [window_start, window_end]
    window_start          timestamptz      NULL,
    window_end            timestamptz      NULL,
    -- the new slot: origin header of its records and its consistent point
    origin                text             NULL,
    consistent_lsn        pg_lsn           NULL,
    rows_recovered        bigint           NULL,
    seconds               double precision NULL,
    unrecoverable         boolean          NOT NULL DEFAULT false,
    accepted_by           text             NULL,
    resolved_at           timestamptz      NULL
);

CREATE INDEX IF NOT EXISTS outbox_cdc_slot_history_slot_idx
    ON outbox_cdc_slot_history (slot, id DESC);
