-- The routing configuration (sinks/routes.py Routing.fingerprint) a parked row was
-- parked or last retried under. The scheduler leaves an UNROUTABLE row alone until
-- the routes or the ignored types change (sinks/claims.py).
ALTER TABLE failed_sync_events
    ADD COLUMN IF NOT EXISTS routes_fingerprint text NULL;
