#!/usr/bin/env bash
# The part of the official postgres image's entrypoint compose/docker-compose.yml relies on:
# * arguments starting with "-" are postgres's (`postgres` is prepended); a command other
#   than postgres runs as it is;
# * started as root: PGDATA is given to postgres and the script runs again as postgres;
# * an empty PGDATA is initialised: initdb as POSTGRES_USER (default postgres) with
#   POSTGRES_PASSWORD (required, as in the official image), local connections trusted,
#   host connections scram-sha-256, listen_addresses '*'; POSTGRES_DB (default: the
#   user's name) created; a non-empty PGDATA is started as it is.
# No /docker-entrypoint-initdb.d, no POSTGRES_HOST_AUTH_METHOD, no POSTGRES_INITDB_ARGS.
set -Eeuo pipefail

if [ "${1:0:1}" = '-' ]; then set -- postgres "$@"; fi
if [ "$1" != postgres ]; then exec "$@"; fi

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" && chmod 700 "$PGDATA" && chown -R postgres:postgres "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$BASH_SOURCE" "$@"
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    : "${POSTGRES_PASSWORD:?the database is uninitialized and POSTGRES_PASSWORD is not set}"
    user=${POSTGRES_USER:-postgres}
    db=${POSTGRES_DB:-$user}
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" --username="$user" --pwfile="$pwfile" -E UTF8 --locale=C \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    printf "host all all all scram-sha-256\n" >>"$PGDATA/pg_hba.conf"
    printf "listen_addresses = '*'\n" >>"$PGDATA/postgresql.conf"
    if [ "$db" != postgres ]; then  # (this build has no psql: single-user mode)
        printf 'CREATE DATABASE "%s";\n' "${db//\"/\"\"}" | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
    echo "PostgreSQL init process complete; ready for start up."
fi

exec "$@"
