-- Least-privilege login for the relay (run by an administrator, not by
-- `outbox-cdc migrate`): it may open a replication connection, read the
-- outbox (the publication needs SELECT for the initial table sync check),
-- and emit heartbeat messages. It owns nothing and writes no table.
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
