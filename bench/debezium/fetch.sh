#!/usr/bin/env bash
# Resolves Debezium's PostgreSQL connector and the Kafka Connect runtime from Maven
# Central (bench/debezium/pom.xml) into .dev/debezium/libs, once per version of the pom,
# and prints that folder. Used by `make bench-compare` (tests/bench/compare); installs
# Java 17 and Maven from Debian's packages when missing, as compose/stack.sh does for
# the Kafka jars.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LIBS="$ROOT/.dev/debezium/libs"
POM="$ROOT/bench/debezium/pom.xml"
STAMP="$LIBS/.pom.sha"

want=$(sha1sum "$POM" | cut -c1-40)
mkdir -p "$ROOT/.dev/debezium"
exec 9>"$ROOT/.dev/debezium/.lock"
flock 9
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
