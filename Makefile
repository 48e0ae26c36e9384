# Two commands do all set-up on a fresh Debian machine:
#   make demo   creates .venv, installs gpuvigil, runs the demo on the simulated cluster
#               (or on real GPUs through NVML where a driver exists)
#   make test   installs the dev/test dependencies and runs the whole suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install install-dev system-deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-dev: install
	$(BIN)/pip install -q -e '.[dev]'
	# CPU build of torch for real gloo ranks in the Flight Recorder tests (test-only).
	$(BIN)/pip install -q 'torch==2.13.0' || echo "torch unavailable: torch-marked tests will be skipped"

# Debian packages the integration tests start for real (needs root; CI runs as root).
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in prometheus prometheus-alertmanager slurm-wlm slurm-client munge; do \
	    dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi; \
	else echo "not root or no apt-get: integration tests needing Prometheus/Alertmanager/Slurm will be skipped"; fi

demo: install
	$(BIN)/gpuvigil demo

test: system-deps install-dev
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
