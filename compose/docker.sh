#!/usr/bin/env bash
# The compose stack (compose/docker-compose.yml) on this machine, as a user runs it -
# with whatever the machine lacks made first:
#
#   compose/docker.sh engine        a Docker engine answering and the compose plugin installed
#   compose/docker.sh images        engine, and every image the stack runs present (pulled,
#                                   or when no registry answers: a stand-in, compose/standins/)
#   compose/docker.sh up [ARGS]     engine, images, the app image, then the docs' command
#                                   with --wait (every healthcheck passing):
#                                   docker compose -f compose/docker-compose.yml up -d --build --wait
#   compose/docker.sh down          docker compose down -v (containers, network, volumes)
#   compose/docker.sh engine-stop   stop the dockerd this script started (nothing else)
#   compose/docker.sh sizes         the size of each image the compose file uses
#
# `make compose-up` / `make compose-down` call it. Each step is skipped when already done:
# * engine: a daemon answering `docker version` is used as it is; otherwise (as root)
#   Debian's docker.io is installed with apt-get when dockerd is missing, and dockerd is
#   started in the background (log /var/log/outbox-cdc-dockerd.log, pid
#   /var/run/outbox-cdc-dockerd.pid). `docker compose` missing: Docker Compose
#   $COMPOSE_VERSION is built from the Go module proxy (`go mod download`, then
#   `go build ./cmd` in a copy of the module: `go install` refuses its go.mod's exclude
#   directives) into the Docker CLI's plugin folder - in the background, while the
#   images below are made (the Go build is the longest step of a fresh machine).
# * images: an image present locally is used; a missing one is pulled (bounded by
#   OUTBOX_COMPOSE_PULL_TIMEOUT_S); when that fails and compose/standins/ has a stand-in
#   of that exact name, the stand-in is built (compose/standins/build.sh). Once the plugin
#   runs, the compose file's own list (`config --images`: its active profiles) is checked.
# * the app image (outbox-cdc:local): built once (`docker compose build migrate`, or with
#   `docker build` while the plugin compiles; the same classic builder, the same layer
#   cache), so `up --build` finds every layer cached.
# ADMIN_API_TOKEN must be set (the compose file refuses to start without it): without it,
# or with an unknown verb, one line and exit 2.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
COMPOSE_FILE="$ROOT/compose/docker-compose.yml"
#: Docker Compose built when the plugin is missing (a Go module; v5 builds with Go 1.24+).
COMPOSE_VERSION=${OUTBOX_COMPOSE_VERSION:-v5.6.0}
COMPOSE_MODULE=github.com/docker/compose/v5
DOCKERD_LOG=/var/log/outbox-cdc-dockerd.log
DOCKERD_PID=/var/run/outbox-cdc-dockerd.pid
PLUGIN_LOG="$ROOT/.dev/compose-plugin-build.log"
#: Bound of waiting for a started dockerd to answer.
DOCKERD_START_TIMEOUT_S=${OUTBOX_DOCKERD_START_TIMEOUT_S:-120}
#: Bound of one `docker pull` (no registry here: it fails fast or hangs on DNS/TCP).
PULL_TIMEOUT_S=${OUTBOX_COMPOSE_PULL_TIMEOUT_S:-30}
#: Bound of `up --wait` (every healthcheck passing); a cold build is inside it.
UP_TIMEOUT_S=${OUTBOX_COMPOSE_UP_TIMEOUT_S:-1200}
#: How long apt-get waits for another apt-get's lock (other stacks install too).
APT_LOCK_TIMEOUT_S=600

log() { printf '[compose] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { log "ERROR: $*"; exit 2; }  # a mistake of the caller: one line, exit 2
now() { date +%s; }

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

# ------------------------------------------------------------------------- the engine
engine_answers() { docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start_dockerd() {
    local t0; t0=$(now)
    [ "$(id -u)" = 0 ] || die "no Docker engine answers and dockerd needs root: start it (dockerd)"
    command -v dockerd >/dev/null 2>&1 || { apt_install docker.io; log "docker.io installed ($(( $(now) - t0 ))s)"; }
    # The package's own service cannot start without an init system here: start it ourselves.
    log "starting dockerd (log $DOCKERD_LOG)"
    setsid nohup dockerd --log-level=warn --pidfile "$DOCKERD_PID" >>"$DOCKERD_LOG" 2>&1 </dev/null &
    local deadline=$(( $(now) + DOCKERD_START_TIMEOUT_S ))
    until engine_answers; do
        [ "$(now)" -lt "$deadline" ] || { tail -n 20 "$DOCKERD_LOG" >&2; die "dockerd did not answer within ${DOCKERD_START_TIMEOUT_S}s"; }
        sleep 1
    done
    log "dockerd $(docker version --format '{{.Server.Version}}') answers ($(( $(now) - t0 ))s)"
}

plugin_dir() {
    # The Docker CLI looks for plugins in ~/.docker/cli-plugins, then the system folders.
    if [ "$(id -u)" = 0 ]; then echo /usr/local/lib/docker/cli-plugins; else echo "$HOME/.docker/cli-plugins"; fi
}

build_compose_plugin() {
    # Quiet (its log: $PLUGIN_LOG); statically linked (CGO_ENABLED=0, as Docker's release
    # builds: no C compiler runs). The module and build caches of Go stay for the next time.
    command -v go >/dev/null 2>&1 || apt_install golang-go
    local dir tmp out t0
    t0=$(now)
    out="$(plugin_dir)/docker-compose"
    log "building Docker Compose $COMPOSE_VERSION from the Go module proxy into $out (log $PLUGIN_LOG)"
    mkdir -p "$(dirname "$PLUGIN_LOG")"
    dir=$(go mod download -json "$COMPOSE_MODULE@$COMPOSE_VERSION" 2>>"$PLUGIN_LOG" |
        python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error")))') ||
        die "go mod download $COMPOSE_MODULE@$COMPOSE_VERSION failed (log $PLUGIN_LOG)"
    tmp=$(mktemp -d)
    cp -r "$dir/." "$tmp/"
    chmod -R u+w "$tmp"
    mkdir -p "$(dirname "$out")"
    # built beside the plugin folder, then renamed into it: no CLI ever runs a half-written one;
    # at a lower CPU priority (nice 10): under `make test` the other lanes come first
    (cd "$tmp" && CGO_ENABLED=0 nice -n 10 go build -trimpath \
        -ldflags "-s -w -X github.com/docker/compose/v5/internal.Version=$COMPOSE_VERSION" \
        -o "$(dirname "$out")/.docker-compose.building" ./cmd) >>"$PLUGIN_LOG" 2>&1 ||
        { rm -rf "$tmp" "$(dirname "$out")/.docker-compose.building"; tail -n 20 "$PLUGIN_LOG" >&2; die "go build of Docker Compose failed (log $PLUGIN_LOG)"; }
    rm -rf "$tmp"
    mv -f "$(dirname "$out")/.docker-compose.building" "$out"
    docker compose version >/dev/null 2>&1 || die "docker compose does not run after the build ($out)"
    log "docker compose $(docker compose version --short) built ($(( $(now) - t0 ))s)"
}

has_plugin() { docker compose version >/dev/null 2>&1; }

engine() {
    local t0; t0=$(now)
    engine_answers || start_dockerd
    has_plugin || build_compose_plugin
    log "engine ready: dockerd $(docker version --format '{{.Server.Version}}'), compose $(docker compose version --short) ($(( $(now) - t0 ))s)"
}

engine_stop() {
    local pid
    pid=$(cat "$DOCKERD_PID" 2>/dev/null || true)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        log "no dockerd started by this script runs"
        return
    fi
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || { log "dockerd stopped"; return; }; sleep 1; done
    die "dockerd (pid $pid) still runs 60s after SIGTERM"
}

# ------------------------------------------------------------------------- the images
compose() { docker compose -f "$COMPOSE_FILE" "$@"; }

external_images() {
    # The images the stack pulls: the compose file's (its active profiles: COMPOSE_PROFILES)
    # but the app image it builds, and the base image(s) of compose/Dockerfile.
    {
        ADMIN_API_TOKEN=${ADMIN_API_TOKEN:-unset} compose config --images
        sed -n 's/^FROM[[:space:]]\{1,\}\([^[:space:]]*\).*/\1/p' "$ROOT/compose/Dockerfile"
    } | sort -u | grep -v '^outbox-cdc:local$' || true
}

images_named() {  # IMAGE...: each present, pulled, or its stand-in built; prints what is left
    local image missing=() left=()
    for image in "$@"; do
        docker image inspect "$image" >/dev/null 2>&1 && continue
        log "pulling $image (at most ${PULL_TIMEOUT_S}s)"
        if timeout "$PULL_TIMEOUT_S" docker pull -q "$image" >/dev/null 2>&1; then continue; fi
        if bash "$ROOT/compose/standins/build.sh" --knows "$image"; then missing+=("$image"); else left+=("$image"); fi
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "no registry gave ${missing[*]}: building stand-ins (compose/standins/)"
        bash "$ROOT/compose/standins/build.sh" "${missing[@]}" || die "a stand-in did not build"
    fi
    echo "${left[*]}"
}

images() {
    # The images the stack runs (compose config: the active profiles) present, or die naming
    # the one no registry and no stand-in gives.
    local t0 left
    t0=$(now)
    # shellcheck disable=SC2046 # one image name per word
    left=$(images_named $(external_images))
    [ -z "$left" ] || die "no registry gives $left and compose/standins has no stand-in of it: pull it on a machine that can (docker save | docker load)"
    log "images ready ($(( $(now) - t0 ))s)"
}

every_named_image() {
    # Every image the compose file and compose/Dockerfile name (all profiles), without
    # the compose plugin: what a fresh machine builds while the plugin compiles.
    { sed -n 's/^[[:space:]]*image:[[:space:]]*\([^[:space:]]*\).*/\1/p' "$COMPOSE_FILE"
      sed -n 's/^FROM[[:space:]]\{1,\}\([^[:space:]]*\).*/\1/p' "$ROOT/compose/Dockerfile"
    } | sort -u | grep -v '^outbox-cdc:local$' || true
}

build_app_image_without_compose() {
    local t0; t0=$(now)
    log "building outbox-cdc:local while the plugin compiles (docker build -f compose/Dockerfile)"
    DOCKER_BUILDKIT=0 docker build -q -f "$ROOT/compose/Dockerfile" -t outbox-cdc:local "$ROOT" \
        >"$ROOT/.dev/app-image-build.log" 2>&1 ||
        { tail -n 30 "$ROOT/.dev/app-image-build.log" >&2; die "the image outbox-cdc:local did not build"; }
    log "image outbox-cdc:local built ($(( $(now) - t0 ))s)"
}

prepare() {
    # engine + images. On a machine without the plugin its build (CPU) runs beside the
    # stand-ins' (downloads, then CPU): the images the file names are made meanwhile, and
    # the compose file's own list is checked once the plugin runs.
    local t0 plugin_pid=""
    t0=$(now)
    engine_answers || start_dockerd
    if ! has_plugin; then
        build_compose_plugin &
        plugin_pid=$!
        # shellcheck disable=SC2046 # one image name per word
        images_named $(every_named_image) >/dev/null
        # the app image too, with the classic builder compose uses without buildx: the
        # compose build that follows finds every layer cached
        if kill -0 "$plugin_pid" 2>/dev/null && ! docker image inspect outbox-cdc:local >/dev/null 2>&1; then
            build_app_image_without_compose
        fi
        wait "$plugin_pid" || die "the compose plugin did not build"
    fi
    log "engine ready: dockerd $(docker version --format '{{.Server.Version}}'), compose $(docker compose version --short) ($(( $(now) - t0 ))s)"
    images
}

sizes() {
    local image
    for image in outbox-cdc:local $(external_images); do
        docker image inspect "$image" >/dev/null 2>&1 || continue
        docker image inspect --format "{{.Size}}" "$image" |
            awk -v i="$image" '{ printf "[compose] image %-28s %6.0f MB\n", i, $1 / 1e6 }' >&2
    done
}

up() {
    local t0
    [ -n "${ADMIN_API_TOKEN:-}" ] || usage "set ADMIN_API_TOKEN (the sink's admin API token), e.g. ADMIN_API_TOKEN=change-me make compose-up"
    prepare
    # The four app services build the one image: built once first, so that `up --build`
    # finds every layer cached (the classic builder would build it four times at once).
    t0=$(now)
    compose build migrate || die "the image outbox-cdc:local did not build"
    log "image outbox-cdc:local built ($(( $(now) - t0 ))s)"
    t0=$(now)
    log "docker compose -f compose/docker-compose.yml up -d --build --wait $*"
    compose up -d --build --wait --wait-timeout "$UP_TIMEOUT_S" "$@" ||
        { compose ps -a >&2 || true; die "the stack did not come up healthy (docker compose logs shows why)"; }
    log "stack up and healthy ($(( $(now) - t0 ))s)"
    compose ps --format 'table {{.Service}}\t{{.Status}}\t{{.Ports}}' >&2
}

down() {
    engine_answers || { log "no Docker engine answers: nothing to take down"; return; }
    ADMIN_API_TOKEN=${ADMIN_API_TOKEN:-unset} compose --profile '*' down -v --remove-orphans
}

case "${1:-}" in
    engine) engine ;;
    engine-stop) engine_stop ;;
    images) prepare ;;
    up) shift; up "$@" ;;
    down) down ;;
    sizes) sizes ;;
    *) usage "usage: $0 engine|images|up [ARGS]|down|sizes|engine-stop" ;;
esac
