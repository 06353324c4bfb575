# outbox-cdc — the two commands are `make demo` and `make test`.
# Everything the project needs is installed by these targets: the Python
# virtualenv (.venv), the PostgreSQL server (Debian package, when missing) and
# the Kafka jars (Maven Central, cached under .dev/kafka/libs).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv up down status lint rules docs test test-unit test-unit-lane test-integration-lane \
	test-integration-lane-b test-integration-lane-c test-integration-lane-d test-pg18-lane test-pg-smoke-lane stack-and-rules bench bench-pg18 \
	demo run stop clean lock wheel compose-up compose-down test-compose-lane test-console test-console-lane \
	bench-compare bench-compare-records bench-plots

help:
	@echo "make demo    stack up, migrate, relay + sink + engine stub, a burst of events, summary"
	@echo "make run | stop   engine stub, relay and sink in the background on the stack (.dev/run)"
	@echo "make test    venv, stack up, ruff + mypy, pytest: the unit lane and eight integration lanes at once (main, B, C, D, pg18, 16/17 smoke, compose, console)"
	@echo "make bench   benchmarks under tests/bench (print figures); the relay's again on PostgreSQL 18"
	@echo "make bench-compare   relay vs pg_recvlogical vs Debezium (as it comes, tuned) on one backlog,"
	@echo "             record for record (about 10 min; not part of make test); bench-compare-records alone"
	@echo "make bench-plots   the benches' JSON figures (.dev/bench) as the PNG charts of docs/performance.md"
	@echo "make rules   promtool: check the Prometheus config and alert rules, run their unit tests"
	@echo "make up | down | status   the local PostgreSQL + Kafka stack (.dev/); make up PG=15|16|17|18"
	@echo "make compose-up | compose-down   the whole pipeline in Docker (compose/docker-compose.yml;"
	@echo "             installs dockerd, the compose plugin and stand-in images where missing)"
	@echo "make test-console   the operator console in a real browser (Debian's chromium, Playwright,"
	@echo "             axe-core) against a pipeline on a stack of its own; make test runs it too"
	@echo "make docs    build the documentation site into site/ (mkdocs --strict: no broken link, no orphan page)"
	@echo "make lock    re-pin compose/requirements.lock (what the image installs) from pyproject.toml"
	@echo "make wheel   build dist/outbox_cdc-*.whl (carries the sql/ migrations)"

# (setuptools' note on every editable install of a package with a package-dir mapping,
# "Editable installation ... folders with the same name": nothing to act on, not shown)
$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e ".[test,docs,bench]"
	@touch $(STAMP)

venv: $(STAMP)

# PG=15|16|17|18 chooses the PostgreSQL server of `make up` (OUTBOX_PG_VERSION): the
# system's packages when they are that version, else fetched into .dev/pg-bin by the
# project's own files (compose/postgres/); PG=system the machine's packages; without PG
# the stack keeps the server it ran last (at first: the system's). `make status` says
# which one runs.
PG ?=
PG_ENV := $(if $(PG),OUTBOX_PG_VERSION=$(PG))

up:
	@$(PG_ENV) bash compose/stack.sh up

down:
	@bash compose/stack.sh down
	@if [ -d "$(LANE_B_DEV)" ]; then export $(LANE_B_ENV) && bash compose/stack.sh down; fi
	@if [ -d "$(LANE_PG18_DEV)" ]; then export $(LANE_PG18_ENV) && bash compose/stack.sh down; fi
	@if [ -d "$(LANE_SMOKE_DEV)" ]; then export $(LANE_SMOKE_ENV) && bash compose/stack.sh down; fi
	@if [ -d "$(BENCH_PG18_DEV)" ]; then export $(BENCH_PG18_ENV) && bash compose/stack.sh down pg; fi

status:
	@bash compose/stack.sh status

lint: venv
	$(BIN)/ruff check cdc sinks tests
	$(BIN)/ruff format --check cdc sinks tests
	$(BIN)/mypy

# promtool comes from Debian's prometheus package, unpacked under .dev/prometheus
# (no service is installed or started); see compose/prometheus/promtool.sh.
rules:
	@bash compose/prometheus/promtool.sh check

# The documentation site (mkdocs.yml, docs/): strict, so a broken link or anchor, a page
# left out of the nav or an undocumented setting fails; offline (no plugin fetches
# anything). make test runs it beside its lanes.
docs: venv
	@NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	@echo "[docs] site built: site/index.html"

test-unit: venv
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

# Eight lanes (and the docs build), all of them must pass:
# - the unit tests need no service: they run beside everything else at the lowest CPU
#   priority (nice 19), taking only CPU the other lanes leave idle;
# - the integration tests that mostly wait (a two-minute engine outage, a minute
#   without Kafka, a minute at the engine's rate limit) run against a second local
#   stack of their own (LANE_B_DEV, other ports), with exactly-once's phases (a backlog,
#   a trickle, a burst; the broker killed amid the commits' overlap) and its production
#   shape (sharded relays, a failure inside a commit, a pause past the transaction
#   timeout, a large repair; about 4 minutes): they stop and start its Kafka and
#   PostgreSQL, never the ones the other integration tests use;
# - the evidence suites (gap evidence, the audit, TLS) and a route down for minutes, on a
#   stack of their own (LANE_C_DEV);
# - the relay's connection and fault suites and exactly-once publishing on another
#   (LANE_D_DEV): they stop and start its PostgreSQL and Kafka;
# - the other integration tests, against the stack of `make up` (the system's PostgreSQL,
#   15 here); they print as they go;
# - the relay's own suites (slot gap, failover, fidelity, relay faults) again on
#   PostgreSQL 18, with the failover-slot tests, on a third stack (LANE_PG18_DEV);
# - a smoke of PostgreSQL 16, then 17 (migrate, stream, a gap, its recovery) on a fourth
#   stack whose Kafka both share (LANE_SMOKE_DEV);
# - the compose lane: the stack of compose/docker-compose.yml in Docker, then the relay's
#   and the sink's smoke tests on testcontainers (test-compose-lane, below).
# The version lanes fetch their servers through compose/postgres into .dev/pg-bin (once,
# under a lock, shared by every stack). The side lanes print their reports when they end
# (also kept under .dev/).
LANE_B_TESTS := tests/integration/test_observability.py tests/integration/test_first_hour.py \
	tests/integration/test_sink_hostile_engine.py tests/integration/test_parking_stuck.py \
	tests/integration/test_distinct_types.py tests/integration/test_exactly_once_phases.py \
	tests/integration/test_relay_blind_path.py tests/integration/test_exactly_once_production.py
LANE_B_DEV   := $(CURDIR)/.dev/lane-b
LANE_B_ENV   := OUTBOX_DEV_DIR=$(LANE_B_DEV) OUTBOX_PG_PORT=25542 OUTBOX_KAFKA_PORT=29192 \
	OUTBOX_KAFKA_CONTROLLER_PORT=29193

#: the relay's evidence suites (gap evidence, the audit, TLS to both services), a route
#: down for minutes (it waits), the sink's byte bounds and a SIGSTOPped broker, every row
#: filter PostgreSQL accepts: lane C
LANE_C_TESTS := tests/integration/test_gap_evidence.py tests/integration/test_audit.py \
	tests/integration/test_tls_services.py tests/integration/test_sink_route_outage.py \
	tests/integration/test_sink_bounds.py tests/integration/test_row_filters.py
LANE_C_DEV   := $(CURDIR)/.dev/lane-c
LANE_C_ENV   := OUTBOX_DEV_DIR=$(LANE_C_DEV) OUTBOX_PG_PORT=25572 OUTBOX_KAFKA_PORT=29492 \
	OUTBOX_KAFKA_CONTROLLER_PORT=29493

#: the relay's connection and fault suites and exactly-once publishing (they stop and start
#: the stack's PostgreSQL and Kafka, drop packets, hold walsenders): lane D
LANE_D_TESTS := tests/integration/test_relay_connections.py tests/integration/test_relay_network_faults.py \
	tests/integration/test_relay_faults.py tests/integration/test_relay_errors.py \
	tests/integration/test_exactly_once.py
LANE_D_DEV   := $(CURDIR)/.dev/lane-d
LANE_D_ENV   := OUTBOX_DEV_DIR=$(LANE_D_DEV) OUTBOX_PG_PORT=25592 OUTBOX_KAFKA_PORT=29592 \
	OUTBOX_KAFKA_CONTROLLER_PORT=29593

#: the relay's suites that run on PostgreSQL 18 too, and the tests that need 17+
RELAY_SUITES := tests/integration/test_slot_gap.py tests/integration/test_slot_failover.py \
	tests/integration/test_record_fidelity.py tests/integration/test_relay_faults.py
PG18_ONLY    := tests/integration/test_failover_slots.py
LANE_PG18_TESTS := $(RELAY_SUITES) $(PG18_ONLY) tests/integration/test_pg_versions.py
LANE_PG18_DEV := $(CURDIR)/.dev/lane-pg18
LANE_PG18_ENV := OUTBOX_DEV_DIR=$(LANE_PG18_DEV) OUTBOX_PG_VERSION=18 OUTBOX_PG_PORT=25552 \
	OUTBOX_KAFKA_PORT=29292 OUTBOX_KAFKA_CONTROLLER_PORT=29293
SMOKE_VERSIONS := 16 17
SMOKE_TESTS  := tests/integration/test_pg_versions.py tests/integration/test_migrations.py \
	tests/integration/test_slot_gap.py::test_first_start_then_a_dropped_slot_is_recovered_with_writers_going_on
LANE_SMOKE_DEV := $(CURDIR)/.dev/lane-smoke
LANE_SMOKE_ENV := OUTBOX_DEV_DIR=$(LANE_SMOKE_DEV) OUTBOX_PG_PORT=25562 OUTBOX_KAFKA_PORT=29392 \
	OUTBOX_KAFKA_CONTROLLER_PORT=29393

test: venv
	@$(MAKE) --no-print-directory -j9 docs test-unit-lane test-integration-lane test-integration-lane-b \
		test-integration-lane-c test-integration-lane-d test-pg18-lane test-pg-smoke-lane test-compose-lane \
		test-console-lane

test-unit-lane: venv
	@mkdir -p .dev
	@echo "[test] unit tests started beside the rest (nice 19); report in .dev/unit-tests.log"
	@nice -n 19 $(BIN)/pytest tests/unit --durations=10 --timeout=900 $(PYTEST_ARGS) \
		>.dev/unit-tests.log 2>&1; rc=$$?; \
		printf "\n[test] unit tests ended (exit %s):\n" $$rc; cat .dev/unit-tests.log; exit $$rc

test-integration-lane: venv lint stack-and-rules
	. ./.dev/env && $(BIN)/pytest tests/integration $(addprefix --ignore=,$(LANE_B_TESTS) $(LANE_C_TESTS) $(LANE_D_TESTS) $(PG18_ONLY)) \
		--durations=25 $(PYTEST_ARGS)

test-integration-lane-b: venv lint stack-and-rules
	@echo "[test] lane B ($(notdir $(LANE_B_TESTS))) started on a second stack; report in .dev/lane-b-tests.log"
	@(export $(LANE_B_ENV) && bash compose/stack.sh up && . "$(LANE_B_DEV)/env" && \
		$(BIN)/pytest $(LANE_B_TESTS) --durations=10 $(PYTEST_ARGS)) >.dev/lane-b-tests.log 2>&1; \
		rc=$$?; (export $(LANE_B_ENV) && bash compose/stack.sh down) >>.dev/lane-b-tests.log 2>&1; \
		printf "\n[test] lane B ended (exit %s):\n" $$rc; cat .dev/lane-b-tests.log; exit $$rc

test-integration-lane-c: venv lint stack-and-rules
	@echo "[test] lane C ($(notdir $(LANE_C_TESTS))) started on a stack of its own; report in .dev/lane-c-tests.log"
	@start=$$(date +%s); (export $(LANE_C_ENV) && bash compose/stack.sh up && . "$(LANE_C_DEV)/env" && \
		$(BIN)/pytest $(LANE_C_TESTS) --durations=10 $(PYTEST_ARGS)) >.dev/lane-c-tests.log 2>&1; \
		rc=$$?; (export $(LANE_C_ENV) && bash compose/stack.sh down) >>.dev/lane-c-tests.log 2>&1; \
		printf "\n[test] lane C ended (exit %s, %ss):\n" $$rc $$(( $$(date +%s) - start )); \
		cat .dev/lane-c-tests.log; exit $$rc

test-integration-lane-d: venv lint stack-and-rules
	@echo "[test] lane D ($(notdir $(LANE_D_TESTS))) started on a stack of its own; report in .dev/lane-d-tests.log"
	@start=$$(date +%s); (export $(LANE_D_ENV) && bash compose/stack.sh up && . "$(LANE_D_DEV)/env" && \
		$(BIN)/pytest $(LANE_D_TESTS) --durations=10 $(PYTEST_ARGS)) >.dev/lane-d-tests.log 2>&1; \
		rc=$$?; (export $(LANE_D_ENV) && bash compose/stack.sh down) >>.dev/lane-d-tests.log 2>&1; \
		printf "\n[test] lane D ended (exit %s, %ss):\n" $$rc $$(( $$(date +%s) - start )); \
		cat .dev/lane-d-tests.log; exit $$rc

test-pg18-lane: venv lint stack-and-rules
	@echo "[test] PostgreSQL 18 lane (the relay's suites, failover slots) started on a third stack; report in .dev/lane-pg18-tests.log"
	@start=$$(date +%s); (export $(LANE_PG18_ENV) && bash compose/stack.sh up && . "$(LANE_PG18_DEV)/env" && \
		$(BIN)/pytest $(LANE_PG18_TESTS) --durations=10 $(PYTEST_ARGS)) >.dev/lane-pg18-tests.log 2>&1; \
		rc=$$?; (export $(LANE_PG18_ENV) && bash compose/stack.sh down) >>.dev/lane-pg18-tests.log 2>&1; \
		printf "\n[test] PostgreSQL 18 lane ended (exit %s, %ss):\n" $$rc $$(( $$(date +%s) - start )); \
		cat .dev/lane-pg18-tests.log; exit $$rc

test-pg-smoke-lane: venv lint stack-and-rules
	@echo "[test] smoke lane (PostgreSQL $(SMOKE_VERSIONS), one Kafka) started; report in .dev/lane-smoke-tests.log"
	@start=$$(date +%s); (set -e; export $(LANE_SMOKE_ENV); for v in $(SMOKE_VERSIONS); do \
		bash compose/stack.sh down pg; OUTBOX_PG_VERSION=$$v bash compose/stack.sh up; \
		. "$(LANE_SMOKE_DEV)/env"; echo "[smoke] PostgreSQL $$v"; \
		OUTBOX_PG_VERSION=$$v $(BIN)/pytest $(SMOKE_TESTS) --durations=5 $(PYTEST_ARGS); \
		done) >.dev/lane-smoke-tests.log 2>&1; \
		rc=$$?; (export $(LANE_SMOKE_ENV) && bash compose/stack.sh down) >>.dev/lane-smoke-tests.log 2>&1; \
		printf "\n[test] smoke lane ended (exit %s, %ss):\n" $$rc $$(( $$(date +%s) - start )); \
		cat .dev/lane-smoke-tests.log; exit $$rc

# The compose lane (docs/getting-started/run-it-yourself.md#the-compose-lane says what it runs):
# `make compose-up` on whatever the machine lacks (dockerd, the compose plugin, stand-in
# images: compose/docker.sh), the pipeline in containers written to and faulted through
# compose (tests/compose, collected by no other lane), `docker compose down -v`; then the
# relay's and the sink's smoke tests on PostgreSQL and Kafka of their own, started with
# testcontainers (OUTBOX_TEST_SERVICES=testcontainers, random host ports). It needs no
# local stack: it starts at once, beside the others. Each phase's time and the image sizes
# are in its report.
COMPOSE_LANE_ENV := ADMIN_API_TOKEN=compose-lane-admin-token INTERNAL_API_KEY=compose-lane-engine-key \
	POSTGRES_PASSWORD=compose-lane-pg-password
TESTCONTAINERS_SMOKE := \
	tests/integration/test_relay.py::test_committed_events_arrive_once_with_the_record_contract \
	tests/integration/test_relay.py::test_sigterm_exits_zero_within_seconds_and_loses_nothing \
	tests/integration/test_sink.py::test_kill_9_of_the_sink_mid_stream_then_restart_applies_everything_once \
	tests/integration/test_kafka_roundtrip.py

compose-up:
	@bash compose/docker.sh up

compose-down:
	@bash compose/docker.sh down

test-compose-lane: venv
	@mkdir -p .dev
	@echo "[test] compose lane (compose up, faults, down; testcontainers smoke) started; report in .dev/lane-compose-tests.log"
	@start=$$(date +%s); (set -e; export $(COMPOSE_LANE_ENV); \
		t=$$(date +%s); bash compose/docker.sh up; echo "[compose-lane] make compose-up: $$(( $$(date +%s) - t ))s"; \
		bash compose/docker.sh sizes; \
		t=$$(date +%s); $(BIN)/pytest tests/compose -p no:randomly -s --durations=10 $(PYTEST_ARGS); \
		echo "[compose-lane] tests/compose: $$(( $$(date +%s) - t ))s"; \
		t=$$(date +%s); OUTBOX_TEST_SERVICES=testcontainers $(BIN)/pytest $(TESTCONTAINERS_SMOKE) \
			-p no:randomly --durations=10 $(PYTEST_ARGS); \
		echo "[compose-lane] testcontainers smoke: $$(( $$(date +%s) - t ))s") >.dev/lane-compose-tests.log 2>&1; \
		rc=$$?; (export $(COMPOSE_LANE_ENV) && bash compose/docker.sh down) >>.dev/lane-compose-tests.log 2>&1; \
		printf "\n[test] compose lane ended (exit %s, %ss):\n" $$rc $$(( $$(date +%s) - start )); \
		cat .dev/lane-compose-tests.log; exit $$rc

# The operator console in a real browser (tests/console): Debian's chromium and axe-core
# (npm, pinned) installed by compose/console-browser.sh when missing, Playwright for Python
# driving the browser (no browser download), a relay, a sink and the engine stub on a
# stack of its own (CONSOLE_DEV, its own ports). Screenshots land in .dev/console-shots
# (docs/operations/console.md shows a set of them). `make test` runs it (test-console-lane).
CONSOLE_DEV := $(CURDIR)/.dev/console
CONSOLE_ENV := OUTBOX_DEV_DIR=$(CONSOLE_DEV) OUTBOX_PG_PORT=$(or $(OUTBOX_CONSOLE_PG_PORT),25612) \
	OUTBOX_KAFKA_PORT=$(or $(OUTBOX_CONSOLE_KAFKA_PORT),29712) \
	OUTBOX_KAFKA_CONTROLLER_PORT=$(or $(OUTBOX_CONSOLE_KAFKA_CONTROLLER_PORT),29713)

test-console: venv
	@start=$$(date +%s); browser=$$(bash compose/console-browser.sh) || exit 1; \
		(export $(CONSOLE_ENV) $$browser OUTBOX_CONSOLE_SHOTS=$(CURDIR)/.dev/console-shots && \
		bash compose/stack.sh up && . "$(CONSOLE_DEV)/env" && \
		$(BIN)/pytest tests/console -p no:randomly --durations=10 $(PYTEST_ARGS)); \
		rc=$$?; (export $(CONSOLE_ENV) && bash compose/stack.sh down); \
		printf "[test] console browser tests ended (exit %s, %ss)\n" $$rc $$(( $$(date +%s) - start )); \
		exit $$rc

#: make test's console lane: make test-console, its report kept in .dev/console-tests.log and
#: printed when it ends (the lanes run in parallel)
test-console-lane: venv
	@mkdir -p .dev
	@echo "[test] console lane (Debian's chromium + Playwright on a stack of its own) started; report in .dev/console-tests.log"
	@$(MAKE) --no-print-directory test-console >.dev/console-tests.log 2>&1; rc=$$?; \
		printf "\n[test] console lane ended (exit %s):\n" $$rc; cat .dev/console-tests.log; exit $$rc

# promtool's package is fetched with apt-get, as the stack's server may be: one after
# the other, never both at once.
# `make test`'s main stack runs the system's server (PG=system) unless PG says otherwise.
stack-and-rules:
	@OUTBOX_PG_VERSION=$(or $(PG),system) bash compose/stack.sh up
	@bash compose/prometheus/promtool.sh check

# Every bench writes its figures as JSON into BENCH_JSON_DIR (tests/bench/report.py,
# write_figures) with the machine, its load and the command; `make bench-plots` draws them.
BENCH_JSON_DIR ?= $(CURDIR)/.dev/bench
BENCH_PLOTS_DIR ?= $(CURDIR)/docs/assets/performance

bench: venv up
	. ./.dev/env && BENCH_JSON_DIR=$(BENCH_JSON_DIR) BENCH_COMMAND="make bench" \
		$(BIN)/pytest tests/bench --ignore=tests/bench/compare -s -p no:randomly $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory bench-pg18

# The relay's drain bench (relay / pg_recvlogical, 1- and 100-event transactions) again on
# PostgreSQL 18, after the others (benchmarks never share the machine): an 18 server of its
# own beside the stack's, the stack's Kafka (warm, the same broker as the 15 figures), the
# 18 build's own pg_recvlogical. Its tables name the server version.
BENCH_PG18_DEV := $(CURDIR)/.dev/bench-pg18
BENCH_PG18_ENV := OUTBOX_DEV_DIR=$(BENCH_PG18_DEV) OUTBOX_PG_VERSION=18 \
	OUTBOX_PG_PORT=$(or $(OUTBOX_BENCH_PG18_PORT),25582) OUTBOX_KAFKA_PORT=$(or $(OUTBOX_KAFKA_PORT),29092)

bench-pg18: venv up
	@(export $(BENCH_PG18_ENV) && bash compose/stack.sh up pg && . "$(BENCH_PG18_DEV)/env" && \
		BENCH_JSON_DIR=$(BENCH_JSON_DIR) BENCH_COMMAND="make bench (bench-pg18)" $(BIN)/pytest tests/bench/test_relay_bench.py -k drains -s -p no:randomly $(PYTEST_ARGS)); \
		rc=$$?; (export $(BENCH_PG18_ENV) && bash compose/stack.sh down pg); exit $$rc

# The relay, pg_recvlogical and Debezium 3.6 (PostgreSQL connector + Outbox Event Router in
# Kafka Connect standalone, jars from Maven Central by bench/debezium/fetch.sh, configured
# by bench/debezium/*.properties: as it comes and tuned) drain one backlog each from a copy
# of one slot, one after the other, into the stack's broker; 1- and 100-event transactions
# (BENCH_COMPARE_EVENTS each, 200,000 by default; BENCH_COMPARE_REPEATS drains per contender,
# the order rotated, medians). Then every Debezium record is compared
# with the relay's: one difference fails the run. Then end to end (test_e2e_compare.py): the
# relay + Kafka + the sink beside Debezium Server 3.6 (PostgreSQL connector, Outbox Event
# Router, HTTP sink: fetch.sh server, bench/debezium/server-application.properties) into one
# HTTP endpoint at 0 and 10 ms of latency (BENCH_E2E_EVENTS 50,000 / BENCH_E2E_EVENTS_10MS
# 5,000), every event's arrival checked. Not part of `make test` (about 13 minutes on the
# 2-core machine). Figures: printed, and JSON in BENCH_JSON_DIR.
bench-compare: venv up
	@bash bench/debezium/fetch.sh >/dev/null
	@bash bench/debezium/fetch.sh server >/dev/null
	. ./.dev/env && BENCH_JSON_DIR=$(BENCH_JSON_DIR) BENCH_COMMAND="make bench-compare" \
		$(BIN)/pytest tests/bench/compare -s -p no:randomly --durations=5 $(PYTEST_ARGS)
	@echo "[bench-compare] figures in $(BENCH_JSON_DIR); make bench-plots draws the charts"

# The record-for-record test alone (a varied outbox, the relay against Debezium as it
# comes); no broker warm-up, as it measures nothing.
bench-compare-records: venv up
	@bash bench/debezium/fetch.sh >/dev/null
	. ./.dev/env && BENCH_JSON_DIR=$(BENCH_JSON_DIR) BENCH_WARMUP_MAX_S=0 \
		BENCH_COMMAND="make bench-compare-records" \
		$(BIN)/pytest tests/bench/compare/test_records_identical.py -s -p no:randomly $(PYTEST_ARGS)

# The charts of docs/performance.md from the JSON of make bench / make bench-compare.
bench-plots: venv
	$(BIN)/python -m tests.bench.plot --json $(BENCH_JSON_DIR) --out $(BENCH_PLOTS_DIR)

demo: venv up
	. ./.dev/env && $(BIN)/outbox-cdc demo

# Day two: the pipeline (engine stub, relay, sink) in the background on the stack, with
# the ports and tokens of .dev/env; PIDs, ports and logs under .dev/run. `make stop` ends
# them (SIGTERM, then SIGKILL after a grace); `outbox-cdc demo write --users N` writes
# a burst into it.
run: venv up
	@. ./.dev/env && $(BIN)/outbox-cdc demo start

stop:
	@if [ -x $(BIN)/outbox-cdc ]; then if [ -f .dev/env ]; then . ./.dev/env; fi; \
		$(BIN)/outbox-cdc demo stop; fi

# The image installs exactly these pins (with hashes); run after changing
# dependencies in pyproject.toml and commit the result.
lock: venv
	$(BIN)/python -m pip install -q "uv>=0.4,<1"
	$(BIN)/uv pip compile pyproject.toml --extra build --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --generate-hashes --quiet \
		--custom-compile-command "make lock" -o compose/requirements.lock

wheel: venv
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean: stop down
	rm -rf .dev $(VENV) build dist site
