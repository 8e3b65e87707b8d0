# The two commands: `make demo` and `make test`. Both set up everything they need on a fresh
# Debian machine (as root): a virtualenv, a Docker engine with gVisor's runsc registered, the
# offline-built tool image.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest engine image browser postgres bench eval clean

demo: $(STAMP) image
	$(PY) -m agent.demo

test: $(STAMP) image lint typecheck pytest

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on disk, never the multi-GB CUDA one an unpinned pull takes.
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[test,local,sglang,eval,toolcalls]'
	# SGLang's function-call parsers without its serving stack (which would replace the pinned torch).
	$(PY) -m pip install --quiet --no-deps 'sglang==0.5.23'
	touch $(STAMP)

engine:
	bash docker/ensure-engine.sh
	bash docker/ensure-runsc.sh

image: engine
	bash docker/build-image.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check sandboxd agent snapshots tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The console's browser tests drive Debian's chromium through its chromedriver: nothing is downloaded at run time.
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; }

# The state-on-PostgreSQL tests start their own server (initdb in a temporary directory) from Debian's package.
postgres:
	command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql; }

pytest: $(STAMP) image browser postgres
	$(PY) -m pytest -q -ra

bench: $(STAMP) image postgres
	$(PY) -m benchmarks.bench_calls
	$(PY) -m benchmarks.bench_snapshots
	$(PY) -m benchmarks.bench_revoke_concurrent
	$(PY) benchmarks/bench_firewall.py
	$(PY) -m benchmarks.bench_revocation
	$(PY) -m benchmarks.bench_revocation_work
	$(PY) -m benchmarks.bench_long_sessions
	$(PY) -m benchmarks.bench_console
	$(PY) -m benchmarks.bench_model_agent
	$(PY) -m benchmarks.bench_state
	$(PY) -m benchmarks.bench_fleet
	$(PY) -m benchmarks.bench_eval --limit 30

# Every method on the built-in suite and on AgentDojo's banking and slack suites, under both release
# policies: tables on stdout, JSON and PNG plots in out/eval (a rerun resumes from the journal).
eval: $(STAMP) image
	for policy in immediate on_commit; do \
	  $(PY) -m agent.eval --suite builtin --suite banking --suite slack --release-policy $$policy \
	    --json out/eval/eval-$$policy.json || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out
