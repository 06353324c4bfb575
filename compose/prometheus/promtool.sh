#!/usr/bin/env bash
# promtool for `make test` and the rule tests, from Debian's `prometheus` package.
#
#   compose/prometheus/promtool.sh path    print promtool's path (fetching it when missing)
#   compose/prometheus/promtool.sh check   check the config and rules, run the rule unit tests
#
# A promtool on PATH is used as it is. Otherwise the package is downloaded with
# apt-get and unpacked under .dev/prometheus (dpkg-deb -x): nothing is installed
# system-wide, no maintainer script runs, so no prometheus service is started.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEV="$ROOT/.dev"
DIR="$DEV/prometheus"
HERE="$ROOT/compose/prometheus"

log() { printf '[promtool] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

promtool_path() {
    if command -v promtool >/dev/null 2>&1; then
        command -v promtool
        return
    fi
    local bin="$DIR/root/usr/bin/promtool"
    if [ ! -x "$bin" ]; then
        command -v apt-get >/dev/null 2>&1 ||
            die "promtool missing and no apt-get: install Prometheus' promtool and put it on PATH"
        mkdir -p "$DIR"
        rm -f "$DIR"/prometheus_*.deb
        log "fetching Debian's prometheus package (for promtool) into $DIR"
        if ! (cd "$DIR" && apt-get download prometheus >/dev/null 2>"$DIR/apt.log"); then
            [ "$(id -u)" = 0 ] || { cat "$DIR/apt.log" >&2; die "apt-get download prometheus failed"; }
            log "apt-get update"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq -o DPkg::Lock::Timeout=600 >&2
            (cd "$DIR" && apt-get download prometheus >/dev/null 2>"$DIR/apt.log") ||
                { cat "$DIR/apt.log" >&2; die "apt-get download prometheus failed"; }
        fi
        rm -rf "$DIR/root"
        dpkg-deb -x "$DIR"/prometheus_*.deb "$DIR/root"
        rm -f "$DIR"/prometheus_*.deb
        [ -x "$bin" ] || die "the prometheus package has no usr/bin/promtool"
    fi
    echo "$bin"
}

case "${1:-check}" in
    path)
        promtool_path
        ;;
    check)
        bin=$(promtool_path)
        "$bin" check config "$HERE/prometheus.yml"
        "$bin" check rules "$HERE"/rules/*.rules.yml
        "$bin" test rules "$HERE"/tests/*.test.yml
        ;;
    *)
        die "usage: $0 path|check"
        ;;
esac
