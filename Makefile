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
	test-integration-lane-b stack-and-rules bench demo clean lock wheel

help:
	@echo "make demo    stack up, migrate, relay + sink + engine stub, a burst of events, summary"
	@echo "make test    venv, stack up, ruff + mypy, pytest (unit, integration, fault)"
	@echo "make bench   benchmarks under tests/bench (print figures)"
	@echo "make rules   promtool: check the Prometheus config and alert rules, run their unit tests"
	@echo "make docs    build the documentation site into site/ (mkdocs --strict: no broken link, no orphan page)"
	@echo "make up | down | status   the local PostgreSQL + Kafka stack (.dev/)"
	@echo "make lock    re-pin compose/requirements.lock (what the image installs) from pyproject.toml"
	@echo "make wheel   build dist/outbox_cdc-*.whl (carries the sql/ migrations)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,docs]"
	@touch $(STAMP)

venv: $(STAMP)

up:
	@bash compose/stack.sh up

down:
	@bash compose/stack.sh down
	@if [ -d "$(LANE_B_DEV)" ]; then export $(LANE_B_ENV) && bash compose/stack.sh down; fi

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

# Three lanes, all of them must pass:
# - the unit tests need no service: they run beside everything else at the lowest CPU
#   priority (nice 19), taking only CPU the other lanes leave idle;
# - the integration tests that mostly wait (a two-minute engine outage, a minute
#   without Kafka, a minute at the engine's rate limit) run against a second local
#   stack of their own (LANE_B_DEV, other ports): they stop and start its Kafka and
#   PostgreSQL, never the ones the other integration tests use;
# - the other integration tests, against the stack of `make up`; they print as they go.
# The two side lanes print their reports when they end (also kept under .dev/).
LANE_B_TESTS := tests/integration/test_observability.py tests/integration/test_first_hour.py \
	tests/integration/test_sink_hostile_engine.py
LANE_B_DEV   := $(CURDIR)/.dev/lane-b
LANE_B_ENV   := OUTBOX_DEV_DIR=$(LANE_B_DEV) OUTBOX_PG_PORT=25542 OUTBOX_KAFKA_PORT=29192 \
	OUTBOX_KAFKA_CONTROLLER_PORT=29193

test: venv
	@$(MAKE) --no-print-directory -j4 docs test-unit-lane test-integration-lane test-integration-lane-b

test-unit-lane: venv
	@mkdir -p .dev
	@echo "[test] unit tests started beside the rest (nice 19); report in .dev/unit-tests.log"
	@nice -n 19 $(BIN)/pytest tests/unit --durations=10 --timeout=900 $(PYTEST_ARGS) \
		>.dev/unit-tests.log 2>&1; rc=$$?; \
		printf "\n[test] unit tests ended (exit %s):\n" $$rc; cat .dev/unit-tests.log; exit $$rc

test-integration-lane: venv lint stack-and-rules
	. ./.dev/env && $(BIN)/pytest tests/integration $(addprefix --ignore=,$(LANE_B_TESTS)) \
		--durations=25 $(PYTEST_ARGS)

test-integration-lane-b: venv lint stack-and-rules
	@echo "[test] lane B ($(notdir $(LANE_B_TESTS))) started on a second stack; report in .dev/lane-b-tests.log"
	@(export $(LANE_B_ENV) && bash compose/stack.sh up && . "$(LANE_B_DEV)/env" && \
		$(BIN)/pytest $(LANE_B_TESTS) --durations=10 $(PYTEST_ARGS)) >.dev/lane-b-tests.log 2>&1; \
		rc=$$?; (export $(LANE_B_ENV) && bash compose/stack.sh down) >>.dev/lane-b-tests.log 2>&1; \
		printf "\n[test] lane B ended (exit %s):\n" $$rc; cat .dev/lane-b-tests.log; exit $$rc

# promtool's package is fetched with apt-get, as the stack's server may be: one after
# the other, never both at once.
stack-and-rules: up
	@bash compose/prometheus/promtool.sh check

bench: venv up
	. ./.dev/env && $(BIN)/pytest tests/bench -s -p no:randomly $(PYTEST_ARGS)

demo: venv up
	. ./.dev/env && $(BIN)/outbox-cdc demo

# The image installs exactly these pins (with hashes); run after changing
# dependencies in pyproject.toml and commit the result.
lock: venv
	$(BIN)/python -m pip install -q "uv>=0.4,<1"
	$(BIN)/uv pip compile pyproject.toml --extra build --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --generate-hashes --quiet \
		--custom-compile-command "make lock" -o compose/requirements.lock

wheel: venv
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w dist .

clean: down
	rm -rf .dev $(VENV) build dist site
