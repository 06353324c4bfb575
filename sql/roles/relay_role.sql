-- Least-privilege login for the relay (run by an administrator, not by
-- `outbox-cdc migrate`): it may open a replication connection, read the
-- outbox (the publication needs SELECT for the initial table sync check),
-- emit heartbeat messages, and keep its slot history (outbox_cdc_slot_history:
-- the slots it made, gaps it found and recovered) and what it published to
-- (outbox_cdc_slot_output). It owns nothing and writes no other table.
--
--   psql "$ADMIN_DSN" -v relay_password="'...'" -f sql/roles/relay_role.sql
--
-- The publication must already exist (migration 001 creates it), because
-- creating a publication needs ownership of the table.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay LOGIN REPLICATION;
    END IF;
END
$$;
ALTER ROLE outbox_relay WITH LOGIN REPLICATION PASSWORD :relay_password;
GRANT CONNECT ON DATABASE :"DBNAME" TO outbox_relay;
GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT ON outbox TO outbox_relay;
GRANT SELECT, INSERT, UPDATE ON outbox_cdc_slot_history TO outbox_relay;
GRANT USAGE ON SEQUENCE outbox_cdc_slot_history_id_seq TO outbox_relay;
GRANT SELECT, INSERT ON outbox_cdc_slot_output TO outbox_relay;
