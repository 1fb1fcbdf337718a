# gpulane — every target sets up .venv itself, so on a fresh machine
# `make test` or `make run` alone is enough.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.DEFAULT_GOAL := help
.PHONY: help run test test-fast lint bench bench-gpu llama clean screenshots

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | sort | awk -F'\t' '{printf "  %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

include mk/llama.mk
include mk/chromium.mk
include mk/postgres.mk

run: $(STAMP) llama ## build llama.cpp + fetch the model on first use, then serve config.example.yaml
	$(VENV)/bin/gpulane serve --config config.example.yaml

lint: $(STAMP) ## ruff + mypy (strict on app/core)
	$(VENV)/bin/ruff check app tests tools bench migrations
	$(VENV)/bin/ruff format --check app tests tools bench migrations
	$(VENV)/bin/mypy

test: lint llama chromium postgres ## lint, then every test (builds llama.cpp, installs chromium and PostgreSQL on first use)
	$(PY) -m pytest -q

test-fast: $(STAMP) postgres ## tests that need no llama.cpp build and no browser
	$(PY) -m pytest -q -m 'not llama and not browser'

bench: $(STAMP) postgres ## benchmarks that print figures (see docs/benchmarks.md)
	$(PY) -m bench.core_bench
	$(PY) -m bench.activity_bench
	$(PY) -m bench.event_store_bench
	$(PY) -m bench.proxy_bench
	$(PY) -m bench.peer_bench
	$(PY) -m bench.recovery_bench
	$(PY) -m bench.pg_bench
	$(PY) -m bench.replay_bench
	$(PY) -m bench.replay_lanes_bench
	if command -v valgrind >/dev/null; then $(PY) -m bench.replay_instructions --lanes; \
	else echo "bench.replay_instructions skipped: valgrind is not installed"; fi
	$(PY) -m bench.swap_bench
	$(PY) -m bench.sleep_bench --live 0.1
	$(PY) -m bench.console_bench
	$(PY) -m bench.live_queue_bench
	$(PY) -m bench.job_body_bench
	$(PY) -m bench.batch_bench
	$(PY) -m bench.failover_bench
	$(PY) -m bench.queue_fill_bench
	for seed in 1 2 3; do $(PY) -m tools.replay generate film --seed $$seed --out /tmp/gpulane-film-$$seed.db --force \
		&& $(PY) -m bench.eta_bench /tmp/gpulane-film-$$seed.db || exit 1; done

bench-gpu: ## real GPU work under score, arrival order, sleep (needs an NVIDIA GPU, PyTorch; installs nothing)
	$(PYTHON) -m bench.gpu_bench $(BENCH_GPU_ARGS)

screenshots: $(STAMP) chromium ## PNGs of every console page from a real run, into docs/ui/
	$(PY) -m tests.browser.screenshots docs/ui

clean: ## remove the venv and caches (not ~/.cache/gpulane)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
