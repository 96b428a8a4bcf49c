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

.PHONY: venv demo test layers test-cuda-emu bench clean venv-vllm test-vllm venv-sglang test-sglang test-integrations venv-lmcache

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the build inputs change (or the stamp is removed). The install also
# compiles the optional native read helper (storage/os/_fastread.c, see setup.py) in place.
NATIVE_SRC := setup.py storage/os/_fastread.c

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
# The suite includes tests/test_cuda_emu.py (`make test-cuda-emu`, below) wherever a C++17
# compiler exists; without one those tests are skipped and this says so up front.
test: venv
	@$(CXX17_CHECK) || echo "make test: no C++17 compiler ($${CXX:-c++}): the CUDA kernels will NOT be executed" \
		"(tests/test_cuda_emu.py, make test-cuda-emu, is SKIPPED)" >&2
	@rc=0; $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then \
		echo "make test: pytest collected no tests" >&2; \
		if [ -n "$${CI:-}" ]; then exit 1; fi; \
		rc=0; \
	fi; \
	exit $$rc

# The import contracts of .importlinter (the layers of tiered_kv.storage, storage importing no
# core, no import circles); part of `make test` too (tests/test_layers.py).
layers: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py

# The CUDA kernels executed on the CPU: each unmodified kernels/*.cu compiled with g++ against
# tests/cuda_emu (a fiber per CUDA thread, counting barriers, 32-lane warps; docs/cuda-emu.md)
# and run against its torch twin on random traces, in a plain and an ASan+UBSan build, plus
# positive controls (broken copies of the kernels) that must fail. FULL=1: the full trace set
# (10x the CI set; not in CI). Builds are cached in $$TMPDIR/tiered_kv_cuda_emu-$$UID.
CXX17_CHECK = printf '\043include <utility>\nint main() { return 0; }\n' | \
	$${CXX:-c++} -std=c++17 -x c++ - -o /dev/null >/dev/null 2>&1
test-cuda-emu: venv
	@$(CXX17_CHECK) || { echo "make test-cuda-emu: no C++17 compiler ($${CXX:-c++}): SKIPPED" >&2; }
	TKV_EMU_FULL=$(FULL) $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_cuda_emu.py $(PYTEST_ARGS)

bench: venv
	@set -e; for b in $(BENCHES); do \
		echo "== $$b --quick"; $(BIN)/python $$b --quick; \
	done

# ---------------------------------------------------------------- engine integrations
# Each engine pins its own torch, so each adapter is tested in a venv of its own against the
# engine's real classes (tests_integrations/<engine>/). `make test-integrations` runs every
# suite (test-<suite>) even when one fails, prints each one's result, and fails if any failed;
# .ci/run calls it after `make test`. The sub-makes read the same makefiles (MAKEFILE_LIST),
# so `make -f Makefile -f extra.mk test-integrations INTEGRATION_SUITES=...` works too
# (tests/test_makefile.py).
INTEGRATION_SUITES ?= vllm sglang

test-integrations:
	@failed=""; summary=""; \
	for suite in $(INTEGRATION_SUITES); do \
		echo "== make test-$$suite"; \
		rc=0; $(MAKE) --no-print-directory $(foreach f,$(MAKEFILE_LIST),-f $(f)) test-$$suite || rc=$$?; \
		if [ $$rc -eq 0 ]; then result="passed"; else result="FAILED (exit $$rc)"; failed="$$failed $$suite"; fi; \
		echo "== test-$$suite: $$result"; \
		summary="$$summary  test-$$suite: $$result\n"; \
	done; \
	printf "== test-integrations:\n$$summary"; \
	if [ -n "$$failed" ]; then echo "make test-integrations: failed:$$failed" >&2; exit 1; fi

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

# ---------------------------------------------------------------- peers of bench/disk.py
# LMCache 0.5.6, for bench/peers/lmcache_disk.py (its local-disk backend, measured beside our
# store by bench/disk.py; vLLM's FS tier runs in .venv-vllm). torch==2.13.0 (CPU) first, then
# LMCache and exactly what its local-disk backend imports, all --no-deps and pinned
# (bench/peers/lmcache-requirements.txt): the full set pulls CUDA. Not part of CI.
LMC_VENV  := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.installed
LMC_REQS  := bench/peers/lmcache-requirements.txt

venv-lmcache: $(LMC_STAMP)

$(LMC_VENV)/bin/python:
	$(PYTHON) -m venv $(LMC_VENV)

$(LMC_STAMP): $(LMC_REQS) | $(LMC_VENV)/bin/python
	$(LMC_VENV)/bin/python -m pip install -q $(TORCH)
	$(LMC_VENV)/bin/python -m pip install -q --no-deps -r $(LMC_REQS)
	$(LMC_VENV)/bin/python -c "import lmcache.v1.storage_backend.local_disk_backend"
	touch $@

# Build outputs and caches; keeps .venv (remove it by hand for a fresh set-up).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis .mypy_cache
	find . -path ./$(VENV) -prune -o -path ./$(VLLM_VENV) -prune -o -path ./$(SGL_VENV) -prune -o -path ./$(LMC_VENV) -prune -o -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
