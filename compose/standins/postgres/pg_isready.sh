#!/bin/sh
# Debian's pg_isready (PostgreSQL 15's client) on the server build's own libpq.
LD_LIBRARY_PATH=/usr/lib/postgresql/16/lib exec /usr/lib/postgresql/16/bin/pg_isready.debian "$@"
