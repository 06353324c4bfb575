-- What the relay needs to trust only evidence it owns (cdc/gaps.py, cdc/relay/gap.py):
--
-- * the identity of every slot it makes (the row that made it: 'created', a
--   recovered or accepted gap, 'adopted'): the slot's catalog_xmin at creation and
--   its confirm limit - the relay never lets the slot confirm past
--   confirm_limit_lsn (it raises the limit, to the server's WAL insert position,
--   before confirming beyond it). A slot whose confirmed_flush_lsn is past the
--   limit was re-created, advanced or streamed by someone else: a gap
--   (slot_replaced), never trusted;
-- * a recovery's progress (resume_from: every row of the window before it is
--   acknowledged by Kafka), so a retry resumes instead of re-publishing the window;
-- * at most one open gap per slot, so two relays cannot both open one;
-- * what the relay has published (outbox_cdc_slot_output): the topics its records
--   went to (the tails it reads at start) and the event forms it published
--   ('message': logical messages, which the outbox table cannot give back).
ALTER TABLE outbox_cdc_slot_history
    ADD COLUMN IF NOT EXISTS slot_catalog_xmin bigint      NULL,
    ADD COLUMN IF NOT EXISTS confirm_limit_lsn pg_lsn      NULL,
    ADD COLUMN IF NOT EXISTS resume_from       timestamptz NULL;

-- Before this migration two relays could both open a gap of one slot: keep the
-- oldest open row (with the earliest window) and close the others as 'superseded'.
WITH open_rows AS (
    SELECT id, slot,
           min(id) OVER (PARTITION BY slot) AS kept,
           CASE WHEN bool_or(window_start IS NULL) OVER (PARTITION BY slot) THEN NULL
                ELSE min(window_start) OVER (PARTITION BY slot) END AS earliest
      FROM outbox_cdc_slot_history
     WHERE state = 'open'
), kept AS (
    UPDATE outbox_cdc_slot_history h
       SET window_start = o.earliest
      FROM open_rows o
     WHERE h.id = o.id AND o.id = o.kept
)
UPDATE outbox_cdc_slot_history h
   SET state = 'superseded', resolved_at = now(),
       detail = h.detail || ' (superseded by gap ' || o.kept || ')'
  FROM open_rows o
 WHERE h.id = o.id AND o.id <> o.kept;

CREATE UNIQUE INDEX IF NOT EXISTS outbox_cdc_slot_history_one_open_gap
    ON outbox_cdc_slot_history (slot) WHERE state = 'open';

CREATE TABLE IF NOT EXISTS outbox_cdc_slot_output (
    slot     text        NOT NULL,
    -- 'topic': a topic the relay published to; 'form': an event form it published
    kind     text        NOT NULL,
    name     text        NOT NULL,
    first_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (slot, kind, name)
);
