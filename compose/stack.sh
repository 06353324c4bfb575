#!/usr/bin/env bash
# Local stack without Docker: PostgreSQL (system server binaries, wal_level=logical)
# and Apache Kafka (KRaft, one combined broker/controller, jars from Maven Central).
#
#   compose/stack.sh up [pg|kafka]     start (idempotent: a running service is left alone)
#   compose/stack.sh down [pg|kafka]   stop (SIGTERM, then SIGKILL after a grace period)
#   compose/stack.sh kill [pg|kafka]   SIGKILL (fault tests)
#   compose/stack.sh status            one line per service
#   compose/stack.sh up standby        a streaming standby of PostgreSQL (OUTBOX_PG_STANDBY_PORT,
#                                      default port+1); `promote standby`; `down standby`
#                                      stops it and removes its data and slot
#
# Everything lives under .dev/ (data, logs, the Kafka jars cache). Ports are
# loopback-only and non-default; override with OUTBOX_PG_PORT, OUTBOX_KAFKA_PORT,
# OUTBOX_KAFKA_CONTROLLER_PORT. `up` writes .dev/env with CDC_PG_DSN and
# KAFKA_BOOTSTRAP_SERVERS. OUTBOX_DEV_DIR puts a second stack's data, logs and env
# elsewhere (with other ports: `make test` runs a lane of tests against one); the
# Kafka jars stay cached in .dev/kafka/libs for every stack. Missing system
# packages (PostgreSQL server, Java, Maven) are installed with apt-get when running
# as root.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEV=${OUTBOX_DEV_DIR:-$ROOT/.dev}
# Below the kernel's ephemeral range (32768-60999), so no client socket can
# hold one of these ports when the stack starts.
PG_PORT=${OUTBOX_PG_PORT:-25432}
PG_STANDBY_PORT=${OUTBOX_PG_STANDBY_PORT:-$((PG_PORT + 1))}
KAFKA_PORT=${OUTBOX_KAFKA_PORT:-29092}
KAFKA_CONTROLLER_PORT=${OUTBOX_KAFKA_CONTROLLER_PORT:-29093}
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
    if [ ! -f "$DEV/.apt-updated" ]; then
        apt-get update -qq >&2 && mkdir -p "$DEV" && touch "$DEV/.apt-updated"
    fi
    apt-get install -y -qq --no-install-recommends "$@" >&2
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

require_free_port() {  # $1 port, $2 the variable that moves it
    if port_open "$1"; then
        die "port 127.0.0.1:$1 is already in use by another program: stop it or set $2"
    fi
}

# ---------------------------------------------------------------- PostgreSQL
pg_bindir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$d" ] || [ ! -x "$d/postgres" ]; then
        # Do not let the package create and start its own cluster on 5432.
        mkdir -p /etc/postgresql-common
        grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf ||
            echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf
        apt_install postgresql postgresql-contrib
        d=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    fi
    echo "$d"
}

# The server refuses to run as root: as root, run it as the unprivileged
# 'postgres' user (created by the Debian package), else as ourselves.
as_pg() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

pg_dir() {
    # .dev/pg when the postgres user can reach it, else a private dir in /tmp.
    local d="$DEV/pg"
    mkdir -p "$d"
    if [ "$(id -u)" = 0 ]; then
        chown postgres: "$d"
        if ! runuser -u postgres -- test -w "$d"; then
            d="/tmp/outbox-cdc-pg-$(echo "${OUTBOX_DEV_DIR:-$ROOT}" | md5sum | cut -c1-8)"
            mkdir -p "$d" && chown postgres: "$d" && chmod 700 "$d"
        fi
    fi
    echo "$d"
}

pg_password() {
    local f="$DEV/pg.password"
    if [ ! -s "$f" ]; then
        mkdir -p "$DEV"
        (umask 077; head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$f")
    fi
    cat "$f"
}

pg_up() {
    local bin dir data pw
    bin=$(pg_bindir)
    dir=$(pg_dir)
    data="$dir/data"
    pw=$(pg_password)
    if [ ! -s "$data/PG_VERSION" ]; then
        log "initdb $data"
        local pwfile="$dir/.pw"
        (umask 077; printf '%s\n' "$pw" > "$pwfile")
        [ "$(id -u)" = 0 ] && chown postgres: "$pwfile"
        as_pg "$bin/initdb" -D "$data" -U "$PG_SUPERUSER" -E UTF8 --locale=C \
            --auth-local=scram-sha-256 --auth-host=scram-sha-256 --pwfile="$pwfile" >"$dir/initdb.log" 2>&1 ||
            { tail -n 30 "$dir/initdb.log" >&2; die "initdb failed"; }
        rm -f "$pwfile"
        mkdir -p "$dir/run" && { [ "$(id -u)" != 0 ] || chown postgres: "$dir/run"; }
        cat >> "$data/postgresql.conf" <<CONF

# --- outbox-cdc local stack ---
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$dir/run'
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
    if as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        log "postgresql already running on 127.0.0.1:$PG_PORT"
    else
        require_free_port "$PG_PORT" OUTBOX_PG_PORT
        log "starting postgresql on 127.0.0.1:$PG_PORT"
        as_pg "$bin/pg_ctl" -D "$data" -l "$dir/postgresql.log" -w -t "$START_TIMEOUT_S" \
            -o "-p $PG_PORT" start >/dev/null ||
            { tail -n 40 "$dir/postgresql.log" >&2; die "postgresql did not start"; }
    fi
    PGPASSWORD=$pw "$bin/psql" -qAt -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres \
        -c "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'" | grep -q 1 ||
        PGPASSWORD=$pw "$bin/psql" -q -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres \
            -c "CREATE DATABASE $PG_DB" >/dev/null
}

pg_stop() {  # $1: pg_ctl mode (fast | immediate)
    local bin dir
    bin=$(pg_bindir); dir=$(pg_dir)
    if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        log "stopping postgresql ($1)"
        as_pg "$bin/pg_ctl" -D "$dir/data" -m "$1" -w stop >/dev/null
    fi
}

pg_status() {
    local bin dir
    bin=$(pg_bindir); dir=$(pg_dir)
    if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        echo "postgresql  up    127.0.0.1:$PG_PORT  data=$dir/data"
    else
        echo "postgresql  down"
    fi
}

# ----------------------------------------------------- PostgreSQL standby
# A streaming standby of the stack's PostgreSQL (pg_basebackup -R, physical slot
# and application_name 'outbox_standby') for trying failover and CDC_STANDBY_SAFE
# by hand; `promote standby` makes it the primary. Never started by `up` alone.
STANDBY_SLOT=outbox_standby

standby_dir() {
    local d
    d="$(pg_dir)-standby"
    mkdir -p "$d"
    [ "$(id -u)" != 0 ] || { chown postgres: "$d"; chmod 700 "$d"; }
    echo "$d"
}

standby_up() {
    local bin dir data pw
    bin=$(pg_bindir); dir=$(standby_dir); data="$dir/data"; pw=$(pg_password)
    as_pg "$bin/pg_ctl" -D "$(pg_dir)/data" status >/dev/null 2>&1 ||
        die "postgresql is not running: compose/stack.sh up pg first"
    if as_pg "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        log "standby already running on 127.0.0.1:$PG_STANDBY_PORT"; return
    fi
    if [ ! -s "$data/PG_VERSION" ]; then
        log "pg_basebackup from 127.0.0.1:$PG_PORT into $data (slot $STANDBY_SLOT)"
        PGPASSWORD=$pw "$bin/psql" -qAt -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres -c \
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name = '$STANDBY_SLOT' AND NOT active" >/dev/null
        as_pg env PGPASSWORD="$pw" "$bin/pg_basebackup" -h 127.0.0.1 -p "$PG_PORT" \
            -U "$PG_SUPERUSER" -D "$data" -X stream -c fast -C -S "$STANDBY_SLOT" >&2 ||
            die "pg_basebackup failed"
        mkdir -p "$dir/run" && { [ "$(id -u)" != 0 ] || chown postgres: "$dir/run"; }
        as_pg touch "$data/standby.signal"
        as_pg tee -a "$data/postgresql.auto.conf" >/dev/null <<CONF
primary_conninfo = 'host=127.0.0.1 port=$PG_PORT user=$PG_SUPERUSER password=$pw application_name=$STANDBY_SLOT'
primary_slot_name = '$STANDBY_SLOT'
unix_socket_directories = '$dir/run'
CONF
    fi
    require_free_port "$PG_STANDBY_PORT" OUTBOX_PG_STANDBY_PORT
    log "starting the standby on 127.0.0.1:$PG_STANDBY_PORT"
    as_pg "$bin/pg_ctl" -D "$data" -l "$dir/postgresql.log" -w -t "$START_TIMEOUT_S" \
        -o "-p $PG_STANDBY_PORT" start >/dev/null ||
        { tail -n 40 "$dir/postgresql.log" >&2; die "the standby did not start"; }
    log "multi-host DSN: host=127.0.0.1,127.0.0.1 port=$PG_PORT,$PG_STANDBY_PORT target_session_attrs=read-write"
}

standby_ctl() {  # $1: promote | down (stop, remove its data and its slot: no WAL pinned)
    local bin dir
    bin=$(pg_bindir); dir=$(standby_dir)
    if [ "$1" = promote ]; then
        as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1 || die "no standby running"
        log "promoting the standby"; as_pg "$bin/pg_ctl" -D "$dir/data" -w promote >/dev/null
        return
    fi
    if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        log "stopping the standby"; as_pg "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    fi
    rm -rf "${dir:?}/data"
    if as_pg "$bin/pg_ctl" -D "$(pg_dir)/data" status >/dev/null 2>&1; then
        PGPASSWORD=$(pg_password) "$bin/psql" -qAt -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" \
            -d postgres -c "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                            WHERE slot_name = '$STANDBY_SLOT' AND NOT active" >/dev/null || true
    fi
}

standby_status() {
    local bin dir
    bin=$(pg_bindir); dir=$(standby_dir)
    if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
        echo "standby     up    127.0.0.1:$PG_STANDBY_PORT  data=$dir/data"
    fi
}

# --------------------------------------------------------------------- Kafka
KAFKA_DIR="$DEV/kafka"
KAFKA_LIBS="$ROOT/.dev/kafka/libs"

kafka_libs() {
    local pom="$ROOT/compose/kafka/pom.xml" stamp="$KAFKA_LIBS/.pom.sha"
    local want
    want=$(sha1sum "$pom" | cut -c1-40)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    command -v java >/dev/null || apt_install openjdk-17-jre-headless
    command -v mvn >/dev/null || apt_install maven
    log "resolving Kafka jars from Maven Central (compose/kafka/pom.xml)"
    rm -rf "$KAFKA_LIBS"
    mvn -q -B -f "$pom" dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory="$KAFKA_LIBS" >&2 || die "mvn could not resolve the Kafka jars"
    echo "$want" > "$stamp"
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

write_env() {
    local pw
    pw=$(pg_password)
    (umask 077; cat > "$DEV/env" <<ENV
export CDC_PG_DSN='postgresql://$PG_SUPERUSER:$pw@127.0.0.1:$PG_PORT/$PG_DB'
export KAFKA_BOOTSTRAP_SERVERS='127.0.0.1:$KAFKA_PORT'
ENV
)
}

main() {
    local cmd=${1:-status} what=${2:-all}
    mkdir -p "$DEV"
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
