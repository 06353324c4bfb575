-- Scheduler claims are leases (sinks/claims.py): a retrier holds a row while
-- claimed_until is in the future; any number of sink instances then attempt
-- each due row at most once, and a crashed claimer's lease simply expires.
ALTER TABLE failed_sync_events
    ADD COLUMN IF NOT EXISTS claimed_by    text        NULL,
    ADD COLUMN IF NOT EXISTS claimed_until timestamptz NULL;
