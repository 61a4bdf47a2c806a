# Developer and CI entry points. The venv is built from pyproject.toml on demand, so a fresh
# clone needs nothing but `make test` (CI runs it through .ci/run).

VENV ?= .venv
PY = $(VENV)/bin/python
# Interpreter used only to create the venv; the project targets 3.11.
BOOTSTRAP_PYTHON ?= $(shell command -v python3.11 || command -v python3)
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck bench dist clean

# Stamps, not phony targets: reinstall only when pyproject.toml changes.
$(VENV)/.installed-dev: pyproject.toml
	test -x $(PY) || $(BOOTSTRAP_PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[dev]'
	touch $@

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(BOOTSTRAP_PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	touch $@

# Keeps its databases in .taskpilots/demo and ends with the `taskpilots show` line to open one.
demo: $(VENV)/.installed
	$(VENV)/bin/taskpilots demo

# Services are required here: a missing PostgreSQL or Redis fails the run instead of skipping.
# Two pytest workers (each starts its own throwaway servers): most of the suite waits on
# subprocesses, fsyncs and servers, so two halve the wall time even on two cores.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed-dev
	TASKPILOTS_REQUIRE_SERVICES=1 $(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

bench: $(VENV)/.installed-dev
	@set -e; for bench in benchmarks/*.py; do \
		[ -e "$$bench" ] || { echo "no benchmarks in benchmarks/"; break; }; \
		echo "==> $$bench"; \
		$(PY) "$$bench"; \
	done

# A wheel in dist/, to install anywhere: pip install dist/taskpilots_graph-*.whl. pip builds
# it with the build backend of pyproject.toml in an isolated environment, so neither the
# venv nor any build tool needs to be installed first.
dist:
	rm -rf dist
	$(BOOTSTRAP_PYTHON) -m pip wheel --no-deps --wheel-dir dist .

# Keeps the venv; delete $(VENV) by hand for a from-scratch install.
clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
