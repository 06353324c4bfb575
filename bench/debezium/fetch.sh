#!/usr/bin/env bash
# Debezium for `make bench-compare` (tests/bench/compare), from Maven Central only, once:
#
#   fetch.sh          Debezium's PostgreSQL connector and the Kafka Connect runtime
#                     (bench/debezium/pom.xml) into .dev/debezium/libs, once per version of
#                     the pom; prints that folder.
#   fetch.sh server   Debezium Server (its distribution tarball, debezium-server-dist) into
#                     .dev/debezium/server-<version>: downloaded once, its SHA-1 checked,
#                     only what runs the PostgreSQL connector and the HTTP sink unpacked
#                     (see fetch_server below); prints that folder.
#
# For the connector: installs Java 17 and Maven from Debian's packages when missing, as
# compose/stack.sh does for the Kafka jars. Debezium Server 3.6 needs Java 21 or later,
# which Debian 12 does not package: the bench finds one (test_e2e_compare.server_java).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LIBS="$ROOT/.dev/debezium/libs"
POM="$ROOT/bench/debezium/pom.xml"
STAMP="$LIBS/.pom.sha"

want=$(sha1sum "$POM" | cut -c1-40)
mkdir -p "$ROOT/.dev/debezium"
exec 9>"$ROOT/.dev/debezium/.lock"
flock 9

# Debezium Server 3.6.1.Final, the distribution Maven Central serves (781 MB). Maven
# Central has no .sha1 beside this file (404, 2026-12-04; nor .md5 / .asc, and its
# maven-metadata.xml lists 3.0.0 and 3.6.0 only), so the SHA-1 is checked against
# Central's .sha1 when there is one, else against the one pinned here - taken from the
# first download, whose Debezium jars inside matched Central's own .sha1 files for
# them (debezium-connector-postgres, debezium-embedded: checked again below, each time).
SERVER_VERSION=3.6.1.Final
SERVER_URL=https://repo1.maven.org/maven2/io/debezium/debezium-server-dist/$SERVER_VERSION/debezium-server-dist-$SERVER_VERSION.tar.gz
SERVER_SHA1=ee31ea4e1a038ac03b9d64646ce2a1bd14adb4f5
# Jars inside the tarball whose SHA-1 Maven Central publishes (groupId io.debezium).
SERVER_CHECKED_JARS=(debezium-connector-postgres debezium-embedded)

fetch_server() {
    local dir="$ROOT/.dev/debezium/server-$SERVER_VERSION"
    local stamp="$dir/.sha1" tarball sha1 want started
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$SERVER_SHA1" ]; then
        echo "$dir"
        return 0
    fi
    # DEBEZIUM_SERVER_TARBALL: a copy already on this machine (another worktree's), checked
    # the same way; else a download, kept only until it is unpacked.
    tarball=${DEBEZIUM_SERVER_TARBALL:-$ROOT/.dev/debezium/debezium-server-dist-$SERVER_VERSION.tar.gz}
    if [ ! -f "$tarball" ]; then
        echo "[debezium] downloading Debezium Server $SERVER_VERSION from Maven Central (781 MB)" >&2
        started=$(date +%s)
        curl -fsS --retry 3 -o "$tarball.part" "$SERVER_URL" >&2
        mv "$tarball.part" "$tarball"
        echo "[debezium] downloaded in $(( $(date +%s) - started )) s" >&2
    fi
    want=$(curl -fsS "$SERVER_URL.sha1" 2>/dev/null | cut -c1-40) || want=""
    if [ -z "$want" ]; then
        echo "[debezium] Maven Central has no .sha1 for the tarball: checking the pinned SHA-1" >&2
        want=$SERVER_SHA1
    fi
    sha1=$(sha1sum "$tarball" | cut -c1-40)
    if [ "$sha1" != "$want" ]; then
        echo "[debezium] $tarball: SHA-1 $sha1, expected $want - removed" >&2
        [ -n "${DEBEZIUM_SERVER_TARBALL:-}" ] || rm -f "$tarball"
        return 1
    fi
    # Only what runs the PostgreSQL connector and the HTTP sink: the runner jar and lib/
    # (Debezium Server's core, its sinks - http among them - and the connectors, one flat
    # class path: its Quarkus runner loads every sink's class at start-up - without the
    # other sinks' jars it stops, ClassNotFoundException - so lib/ stays whole). Left
    # out: connectors/ (Cassandra's, 351 MB), lib_opt/ (scripting, Chronicle Queue), the
    # metrics agents, run.bat. run.sh is kept to show the command the bench runs.
    rm -rf "$dir" "$dir.tmp"
    mkdir -p "$dir.tmp"
    tar -xzf "$tarball" -C "$dir.tmp" --strip-components=1 \
        "debezium-server/debezium-server-dist-$SERVER_VERSION-runner.jar" \
        debezium-server/lib debezium-server/run.sh
    for jar in "${SERVER_CHECKED_JARS[@]}"; do
        local file="$dir.tmp/lib/$jar-$SERVER_VERSION.jar" central
        central=$(curl -fsS "https://repo1.maven.org/maven2/io/debezium/$jar/$SERVER_VERSION/$jar-$SERVER_VERSION.jar.sha1" | cut -c1-40)
        if [ "$(sha1sum "$file" | cut -c1-40)" != "$central" ]; then
            echo "[debezium] $jar in the tarball differs from Maven Central's ($central)" >&2
            rm -rf "$dir.tmp"
            return 1
        fi
    done
    echo "$SERVER_SHA1" > "$dir.tmp/.sha1"
    mv "$dir.tmp" "$dir"
    [ -n "${DEBEZIUM_SERVER_TARBALL:-}" ] || rm -f "$tarball"
    echo "[debezium] Debezium Server $SERVER_VERSION unpacked in $dir ($(du -sm "$dir" | cut -f1) MB)" >&2
    echo "$dir"
}

if [ "${1:-}" = "server" ]; then
    fetch_server
    exit $?
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "$LIBS"
    exit 0
fi
missing=()
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null || missing+=(maven)
if [ ${#missing[@]} -gt 0 ]; then
    echo "[debezium] installing ${missing[*]} (Debian packages)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 || {
        apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
    }
fi
echo "[debezium] resolving Debezium and Kafka Connect from Maven Central (bench/debezium/pom.xml)" >&2
rm -rf "$LIBS"
mvn -q -B -f "$POM" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$LIBS" >&2
echo "$want" > "$STAMP"
echo "$LIBS"
