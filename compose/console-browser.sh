#!/usr/bin/env bash
# What the console's browser test needs, installed by the project's own files
# (`make test-console` calls it; each step is skipped when already done):
#
#   compose/console-browser.sh          Debian's chromium (apt-get, as root) and axe-core
#                                       $AXE_VERSION from npm into $AXE_DIR; then prints the
#                                       two lines the test reads:
#                                         OUTBOX_CHROMIUM=/usr/bin/chromium
#                                         OUTBOX_AXE_JS=<AXE_DIR>/node_modules/axe-core/axe.min.js
#
# No browser is ever downloaded by Playwright (the test launches Debian's chromium with
# `executable_path`); axe-core is a pinned npm package (MPL-2.0) kept in a cache folder
# (.dev/axe-core-<version> by default), never in the repository.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
#: The axe-core release the accessibility pass runs (npm, pinned).
AXE_VERSION=4.14.1
AXE_DIR=${OUTBOX_AXE_DIR:-$ROOT/.dev/axe-core-$AXE_VERSION}
#: How long apt-get waits for another apt-get's lock (other stacks install too).
APT_LOCK_TIMEOUT_S=600

log() { printf '[console-browser] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

apt_install() {
    [ "$(id -u)" = 0 ] || die "missing $*: install it (apt-get install $*) or run as root"
    export DEBIAN_FRONTEND=noninteractive
    log "installing $* (apt-get)"
    if ! apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S \
            "$@" >/dev/null 2>&1; then
        apt-get update -qq -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S >&2
        apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=$APT_LOCK_TIMEOUT_S \
            "$@" >&2
    fi
}

chromium_path() {
    command -v chromium >/dev/null 2>&1 || apt_install chromium
    command -v chromium || die "chromium not found after apt-get install chromium"
}

axe_path() {
    local js="$AXE_DIR/node_modules/axe-core/axe.min.js"
    if [ ! -f "$js" ]; then
        command -v npm >/dev/null 2>&1 || apt_install npm
        log "installing axe-core@$AXE_VERSION (npm) into $AXE_DIR"
        mkdir -p "$AXE_DIR"
        npm install --prefix "$AXE_DIR" --no-save --no-audit --no-fund --loglevel=error \
            "axe-core@$AXE_VERSION" >&2
    fi
    [ -f "$js" ] || die "axe-core not installed at $js"
    printf '%s\n' "$js"
}

chromium=$(chromium_path)
axe=$(axe_path)
printf 'OUTBOX_CHROMIUM=%s\nOUTBOX_AXE_JS=%s\n' "$chromium" "$axe"
