# Set-up, demo, tests and benchmarks. A fresh machine needs only `make demo` or `make test`:
# both create .venv and install the project first.
#
# torch==2.13.0 is installed before the project: it resolves to the local CPU wheel, while a
# looser torch requirement resolved first would pull a multi-GB CUDA build from PyPI.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
# The build backend of pyproject's [build-system], so that wheels build offline with
# --no-build-isolation (tests/test_packaging.py). A fresh 3.11 venv has setuptools 65.
BUILD_DEPS := "setuptools>=68" wheel
PYTEST_ARGS ?=
BENCHES := $(filter-out bench/_%,$(wildcard bench/*.py))  # bench/_*.py: children run by a bench

.PHONY: venv demo test bench clean venv-vllm test-vllm venv-sglang test-sglang test-integrations

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the build inputs change (or the stamp is removed). The install also
# compiles the optional native read helper (storage/_fastread.c, see setup.py) in place.
NATIVE_SRC := setup.py storage/_fastread.c

$(STAMP): pyproject.toml $(NATIVE_SRC) | $(BIN)/python
	$(BIN)/python -m pip install $(TORCH) $(BUILD_DEPS)
	$(BIN)/python -m pip install -e '.[test,bench]'
	touch $@

# The memory plans of both presets, then the warm-start demo (tiered_kv/demo.py): on a fresh
# LMDB store under .demo/, `tiered-kv warm-start` cold then warm, `stats` and `verify`.
demo: venv
	$(BIN)/tiered-kv plan --model deepseek-v4-flash --context 1M
	$(BIN)/tiered-kv plan --model deepseek-v4-pro --context 1M
	$(BIN)/python -m tiered_kv.demo

# pytest exits 5 when it collects no tests: fine locally (e.g. PYTEST_ARGS='-k nothing'),
# a failure in CI (CI set), where zero tests means the suite went missing.
test: venv
	@rc=0; $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then \
		echo "make test: pytest collected no tests" >&2; \
		if [ -n "$${CI:-}" ]; then exit 1; fi; \
		rc=0; \
	fi; \
	exit $$rc

bench: venv
	@set -e; for b in $(BENCHES); do \
		echo "== $$b --quick"; $(BIN)/python $$b --quick; \
	done

# ---------------------------------------------------------------- engine integrations
# Each engine pins its own torch, so each adapter is tested in a venv of its own against the
# engine's real classes (tests_integrations/<engine>/). `make test-integrations` runs them
# all; .ci/run calls it after `make test`.
test-integrations: test-vllm test-sglang

# vLLM 0.33 without its ~9 GB CUDA dependency set: torch==2.13.0 CPU first, then vLLM and
# exactly the modules its tiering package imports, all --no-deps and pinned
# (tests_integrations/vllm/requirements.txt), then tiered_kv editable.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REQS  := tests_integrations/vllm/requirements.txt

venv-vllm: $(VLLM_STAMP)

$(VLLM_VENV)/bin/python:
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): $(VLLM_REQS) pyproject.toml $(NATIVE_SRC) | $(VLLM_VENV)/bin/python
	$(VLLM_VENV)/bin/python -m pip install $(TORCH) $(BUILD_DEPS)
	$(VLLM_VENV)/bin/python -m pip install --no-deps -r $(VLLM_REQS)
	$(VLLM_VENV)/bin/python -m pip install --no-deps --no-build-isolation -e .
	touch $@

test-vllm: venv-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests_integrations/vllm $(PYTEST_ARGS)

# SGLang adapter (tiered_kv.integrations.sglang) against the real SGLang 0.5.23 classes, in its
# own venv: SGLang pins its own torch, so it never shares .venv. torch==2.13.0 (CPU) first, then
# sglang and the packages its storage / host-pool modules import, all --no-deps (the full set
# pulls CUDA kernels), then this project editable.
SGL_VENV  := .venv-sglang
SGL_BIN   := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.installed
SGL_REQS  := tests_integrations/sglang/requirements.txt
SGLANG    := sglang==0.5.23

venv-sglang: $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml $(NATIVE_SRC) $(SGL_REQS)
	$(PYTHON) -m venv $(SGL_VENV)
	$(SGL_BIN)/python -m pip install -q $(TORCH) $(BUILD_DEPS)
	$(SGL_BIN)/python -m pip install -q --no-deps $(SGLANG) -r $(SGL_REQS)
	$(SGL_BIN)/python -m pip install -q --no-deps -e .
	touch $@

test-sglang: venv-sglang
	@rc=0; $(SGL_BIN)/python -m pytest -q -p no:cacheprovider tests_integrations/sglang $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-sglang: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# Build outputs and caches; keeps .venv (remove it by hand for a fresh set-up).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis .mypy_cache
	find . -path ./$(VENV) -prune -o -path ./$(VLLM_VENV) -prune -o -path ./$(SGL_VENV) -prune -o -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
