# outbox-cdc — the two commands are `make demo` and `make test`.
# Everything the project needs is installed by these targets: the Python
# virtualenv (.venv), the PostgreSQL server (Debian package, when missing) and
# the Kafka jars (Maven Central, cached under .dev/kafka/libs).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: help venv up down status lint rules test test-unit bench demo clean lock wheel

help:
	@echo "make demo    stack up, migrate, relay + sink + engine stub, a burst of events, summary"
	@echo "make test    venv, stack up, ruff + mypy, pytest (unit, integration, fault)"
	@echo "make bench   benchmarks under tests/bench (print figures)"
	@echo "make rules   promtool: check the Prometheus config and alert rules, run their unit tests"
	@echo "make up | down | status   the local PostgreSQL + Kafka stack (.dev/)"
	@echo "make lock    re-pin compose/requirements.lock (what the image installs) from pyproject.toml"
	@echo "make wheel   build dist/outbox_cdc-*.whl (carries the sql/ migrations)"

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	@touch $(STAMP)

venv: $(STAMP)

up:
	@bash compose/stack.sh up

down:
	@bash compose/stack.sh down

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

test-unit: venv
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

test: venv up lint rules
	. ./.dev/env && $(BIN)/pytest tests/unit tests/integration --durations=25 $(PYTEST_ARGS)

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
	rm -rf .dev $(VENV) build dist
