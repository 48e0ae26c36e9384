# Two commands do all set-up on a fresh Debian machine:
#   make demo   creates .venv, installs gpuvigil, runs the demo on the simulated cluster
#               (or on real GPUs through NVML where a driver exists)
#   make test   installs the dev/test dependencies and runs the whole suite, then the unit tests
#               again on the lowest dependency versions pyproject.toml allows (test-lowest)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo lint test test-deep test-lowest mutate install install-dev system-deps clean report-screenshot

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e .

install-dev: install
	$(BIN)/pip install -q -e '.[dev]'
	# CPU build of torch for real gloo ranks (Flight Recorder, hang and straggler tests): test-only,
	# and required: without it the install fails rather than the suite passing by skipping.
	$(BIN)/pip install -q -e '.[torch]'

# Debian packages the integration tests start for real (needs root; CI runs as root).
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=""; for p in prometheus prometheus-alertmanager slurm-wlm slurm-client munge chromium nats-server; do \
	    dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	  if [ -n "$$missing" ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi; \
	else echo "not root or no apt-get: install$$(for p in prometheus prometheus-alertmanager slurm-wlm slurm-client munge chromium nats-server; do dpkg -s $$p >/dev/null 2>&1 || printf ' %s' $$p; done) yourself, or the service tests skip (under CI=true a skip fails the run)"; fi

demo: install
	$(BIN)/gpuvigil demo

# The suite runs on every core (pytest-xdist, a file per worker so module fixtures run once);
# the hypothesis equivalence tests draw a quarter of their examples (tests/hyp.py).
TEST_JOBS ?= auto
# ruff's rules are in pyproject.toml [tool.ruff]; the code is linted, not reformatted.
lint: install-dev
	$(BIN)/ruff check .

test: system-deps install-dev lint
	$(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile
	$(MAKE) test-lowest

# The same suite with every hypothesis equivalence test at its full example count.
test-deep: system-deps install-dev
	GPUVIGIL_TEST_DEEP=1 $(BIN)/python -m pytest -q -ra -n $(TEST_JOBS) --dist loadfile

# The floors in pyproject.toml are true: a second venv gets the lowest version of every direct
# dependency (uv --resolution lowest-direct) and the unit tests that exercise each library's API
# run there (not the service or torch tests; ~5 min). The kubernetes extra comes second: its
# floor (37) needs pydantic >= 2.13.5 and would otherwise hide pydantic's. docs/dependencies.md.
LOW_VENV ?= .venv-lowest
LOW_UV = VIRTUAL_ENV="$(CURDIR)/$(LOW_VENV)" $(BIN)/uv pip
LOW_PYTEST = $(LOW_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) -m "not services and not torch"
LOW_SHOW = grep -iE '^(polars|numpy|pydantic|fastapi|anyio|uvicorn|httpx|prometheus-client|opentelemetry-sdk|nvidia-ml-py|pyyaml|rich|python-hostlist|kubernetes|grafanalib)=='
LOWEST_TESTS ?= tests/test_dcgm.py tests/test_config_whole.py tests/test_hostlist.py tests/test_backoff.py \
	tests/test_instrument_stdlib.py tests/test_dashboards.py tests/test_detectors_units.py tests/test_exporter.py \
	tests/test_otel.py tests/test_nvml.py tests/test_slurm_parse.py tests/test_api_app.py \
	tests/test_extras.py tests/test_alerts.py
test-lowest: install-dev
	$(BIN)/pip install -q 'uv>=0.5'
	rm -rf $(LOW_VENV)
	$(BIN)/uv venv -q --python "$$(command -v $(PY))" $(LOW_VENV)
	$(LOW_UV) install -q --resolution lowest-direct -e '.[build,test]'
	$(LOW_UV) freeze | $(LOW_SHOW)
	$(LOW_PYTEST) $(LOWEST_TESTS)
	$(LOW_UV) install -q --resolution lowest-direct -e '.[build,test,kubernetes]'
	$(LOW_UV) freeze | $(LOW_SHOW)
	$(LOW_PYTEST) tests/test_kubernetes_adapter.py

# Mutation testing of gpuvigil/detectors/ and gpuvigil/pipeline/ (mutmut 3, config [tool.mutmut] in
# pyproject.toml): each mutant runs only the fast tests that cover it. CPU-heavy (docs/testing.md
# has the measured score and every survivor); MUTATE_JOBS sets the parallel workers.
MUTATE_JOBS ?= 2
# Address-space cap of mutmut and its children, in KiB (6 GB; the selected tests pass under it): a
# mutant that never ends a loop (KeyRing.insert's doubling loop did) fails with MemoryError, i.e. is
# killed, instead of taking the machine's memory.
MUTATE_VMEM_KB ?= 6000000
mutate: install-dev
	$(BIN)/pip install -q -e '.[mutate]'
	rm -rf mutants
	ulimit -v $(MUTATE_VMEM_KB) && $(BIN)/mutmut run --max-children $(MUTATE_JOBS)
	$(BIN)/mutmut results

# docs/report-screenshot.png: the HTML report of a replay of the real H200 captures (NVML series
# at ~0.1 s; the capacity OOM's log, which has no timestamps, placed with --at at the end of the
# series' OOM ramp; the NCCL watchdog timeout and its Flight Recorder dump), drawn by Chromium.
# GPUVIGIL: how to run the CLI (default: this venv's, after `make install` with the report extra;
# e.g. "env PYTHONPATH=$PWD python -m gpuvigil" in a checkout). Needs chromium.
GPUVIGIL ?= $(BIN)/gpuvigil
H200 := tests/data/h200
REPORT_HTML ?= $(CURDIR)/.report-screenshot.html
report-screenshot:
	$(GPUVIGIL) replay $(H200)/nvml_timeseries.csv $(H200)/s2_oom_ramp.log $(H200)/s6_nccl_watchdog_timeout.log $(H200)/s6_fr_rank_0 \
	  --at 2026-11-29T23:06:52.7Z --step 1s --node h200-node-1 --job capture --report $(REPORT_HTML) > /dev/null
	chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --host-resolver-rules="MAP * ~NOTFOUND" --virtual-time-budget=15000 \
	  --window-size=1400,1450 --user-data-dir=$$(mktemp -d) --screenshot=$(CURDIR)/docs/report-screenshot.png file://$(REPORT_HTML) 2>/dev/null
	rm -f $(REPORT_HTML)

clean:
	rm -rf $(VENV) $(LOW_VENV) .pytest_cache .hypothesis mutants
