#!/usr/bin/env bash
# The GPU check of tiered_kv: one prepared script for a machine with an NVIDIA GPU.
#
#   bash bench/gpu_check.sh          # from the repository root; at most ~8 minutes
#
# Steps, each under its own timeout:
#   1. environment: GPU, torch/CUDA, and which Python packages are missing (nothing is
#      installed: a missing one is reported with what it costs)
#   2. the gpu-marked tests:  python -m pytest -m gpu -q tests/
#   3. the emulator's traces on the real kernels: tests/cuda_emu/traces.py --device cuda runs
#      the very traces CI runs on the CPU emulator (make test-cuda-emu), every kernels/*.cu
#      against its torch twin, launched by CuPy through cuda_ops (a table per kernel family)
#   4. bench/gpu_bench.py: copy engine vs one large memcpy (GB/s, ratio), HiSparse
#      swap-in latency (kernels.swap_in torch / cuda, HiSparseBuffers.swap_in end to end),
#      the batched swap-in per CSA layer (B = 1..64, eager and CUDA-graph replayed;
#      one whole Flash decode step's 21 layers) with a PNG beside the JSON, and the host
#      cost of building one launch
#   5. bench/write_path.py --device cuda --quick: host time per Flash block on the write path
# With .whl/ present (bash bench/device_wheels.sh here, then carry .whl), lmdb and zarr are
# installed into a temporary --target folder first, so the disk-backed gpu tests run too:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# JSON goes to $OUT/gpu.json when OUT is set (the test log to $OUT/gpu_tests.log, the trace
# table to $OUT/gpu_traces.json), else to bench/results/gpu.json. Without CUDA the script
# says so and exits 0.
#
# Environment: PYTHON (interpreter; default .venv/bin/python if present, else python3),
# GPU_CHECK_SHIM=1 (import tiered_kv from this checkout even if a copy is installed),
# T_ENV / T_TESTS / T_TRACES / T_BENCH (step timeouts in seconds: 30 per environment probe /
# 180 / 90 / 150, + 45 for step 5; all steps together stay under 8 minutes).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
T_ENV=${T_ENV:-30}
T_TESTS=${T_TESTS:-180}
T_TRACES=${T_TRACES:-90}
T_BENCH=${T_BENCH:-150}  # + 45 s for step 5: all steps stay under 8 minutes
if [[ -n "${PYTHON:-}" ]]; then
    PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
# Never import tiered_kv from the current directory by accident: the checkout's
# tiered_kv/ lacks the kernels/ and storage/ subpackages an install maps into it
# (PYTHONSAFEPATH needs Python >= 3.11, as on the GPU machines: 3.12).
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-}
JSON=${OUT_DIR:+$OUT_DIR/gpu.json}
JSON=${JSON:-$ROOT/bench/results/gpu.json}
TEST_LOG=${OUT_DIR:+$OUT_DIR/gpu_tests.log}
TEST_LOG=${TEST_LOG:-/dev/null}
TRACES_JSON=${OUT_DIR:+$OUT_DIR/gpu_traces.json}
TRACES_JSON=${TRACES_JSON:-$ROOT/bench/results/gpu_traces.json}
if [[ -n "$OUT_DIR" ]]; then
    mkdir -p "$OUT_DIR"
fi

step() { printf '\n=== %s\n' "$*"; }
run_limited() {  # run_limited SECONDS CMD...: the command under a timeout (TERM, then KILL)
    local limit=$1
    shift
    timeout --signal=TERM --kill-after=10 "$limit" "$@"
}

# ---------------------------------------------------------------- 0. CUDA at all?
step "0. CUDA ($PY)"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no Python interpreter '$PY'; set PYTHON=... . Nothing checked; exit 0."
    exit 0
fi
cuda_rc=0
run_limited "$T_ENV" "$PY" - <<'EOF' || cuda_rc=$?
import sys
try:
    import torch
except ImportError as exc:
    print(f"torch is not importable ({exc})")
    sys.exit(3)
try:
    ok = torch.cuda.is_available()
except RuntimeError as exc:
    print(f"torch {torch.__version__}: CUDA check failed ({exc})")
    sys.exit(3)
if not ok:
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
    sys.exit(3)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): "
      f"{torch.cuda.get_device_name(0)}")
EOF
if [[ $cuda_rc -ne 0 ]]; then
    echo "gpu_check: no usable CUDA device on this machine: nothing to check here. Exit 0."
    echo "(Run this script on a machine with an NVIDIA GPU and CUDA-enabled torch.)"
    exit 0
fi

# ------------------------------------------------ 1. import path and environment
step "1. environment"
if [[ "${GPU_CHECK_SHIM:-0}" == 1 ]] || ! run_limited "$T_ENV" "$PY" -c 'import tiered_kv.kernels' >/dev/null 2>&1; then
    # Not installed: lay the package out as setuptools' package-dir does (tiered_kv/,
    # kernels/ -> tiered_kv.kernels, storage/ -> tiered_kv.storage) with symlinks.
    SHIM=$(mktemp -d "${TMPDIR:-/tmp}/tiered_kv_shim.XXXXXX")
    trap 'rm -rf "$SHIM"' EXIT
    mkdir "$SHIM/tiered_kv"
    for entry in "$ROOT"/tiered_kv/*; do
        [[ $(basename "$entry") == __pycache__ ]] || ln -s "$entry" "$SHIM/tiered_kv/"
    done
    ln -s "$ROOT/kernels" "$SHIM/tiered_kv/kernels"
    ln -s "$ROOT/storage" "$SHIM/tiered_kv/storage"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "tiered_kv: imported from this checkout through $SHIM (not pip-installed)"
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    # lmdb, zarr and their needs, downloaded by bench/device_wheels.sh and carried here
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/tiered_kv_site.XXXXXX")
    if run_limited 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        echo "installed .whl/ into $SITE (on PYTHONPATH)"
    else
        echo "(installing .whl/ failed: the storage-backed gpu tests will not collect)"
    fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    run_limited 10 nvidia-smi -L || echo "(nvidia-smi -L failed)"
else
    echo "(nvidia-smi not on PATH)"
fi
missing_test_deps=0
run_limited "$T_ENV" "$PY" - <<'EOF' || missing_test_deps=$?
import importlib.metadata as md
import importlib.util
import platform
import sys

print(f"python {platform.python_version()} ({sys.executable})")
needs = [  # (module, distribution, what is lost without it)
    ("torch", "torch", "everything"),
    ("numpy", "numpy", "tiered_kv itself"),
    ("xxhash", "xxhash", "tiered_kv itself (prefix hashing)"),
    ("cupy", None, "impl='cuda' kernels: CUDA kernel tests skip, gpu_bench reports torch only"),
    ("pytest", "pytest", "step 2 (the gpu-marked tests)"),
    ("hypothesis", "hypothesis", "collection of some test modules"),
    ("lmdb", "lmdb", "storage test modules (none gpu-marked): step 2 runs the gpu test files only"),
    ("zarr", "zarr", "storage test modules (none gpu-marked): step 2 runs the gpu test files only"),
]
missing = []
for module, dist, loses in needs:
    found = importlib.util.find_spec(module) is not None
    version = ""
    if found and dist:
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            version = "?"
    if found and module == "cupy":
        try:
            import cupy

            version = f"{cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s)"
        except Exception as exc:  # report, do not stop: only impl='cuda' needs it
            found, loses = False, f"{loses} [cupy import/device query failed: {exc}]"
    print(f"  {module:<11} {('ok ' + version) if found else 'MISSING':<28} {'' if found else 'without it: ' + loses}")
    if not found:
        missing.append(module)
if missing:
    print(f"missing (not installed by this script): {', '.join(missing)}")
try:
    import tiered_kv.kernels
except ImportError as exc:
    print(f"tiered_kv is NOT importable: {exc}")
    sys.exit(2)
print(f"tiered_kv from {tiered_kv.__file__}, kernels from {tiered_kv.kernels.__file__}")
sys.exit(1 if {"lmdb", "zarr", "hypothesis"} & set(missing) else 0)
EOF

# ------------------------------------------------------------ 2. gpu-marked tests
step "2. gpu-marked tests (timeout ${T_TESTS}s)"
targets=(tests/)
if [[ $missing_test_deps -eq 1 ]]; then
    # Collecting the storage tests would fail on the missing module; run the files that
    # hold gpu-marked tests instead.
    mapfile -t targets < <(grep -rlE 'mark\.gpu' tests --include='test_*.py' | sort)
    echo "running only the files with gpu-marked tests: ${targets[*]}"
fi
set +e
run_limited "$T_TESTS" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider "${targets[@]}" 2>&1 | tee "$TEST_LOG"
tests_rc=${PIPESTATUS[0]}
set -e

# --------------------------------------------- 3. the emulator's traces on the GPU
step "3. the CI traces (tests/cuda_emu) on the real kernels (timeout ${T_TRACES}s) -> $TRACES_JSON"
set +e
run_limited "$T_TRACES" "$PY" tests/cuda_emu/traces.py --device cuda --json "$TRACES_JSON"
traces_rc=$?
set -e
if [[ $traces_rc -eq 3 ]]; then
    traces_rc=0
    traces_note="skipped (see above: the CUDA kernels cannot run here)"
fi

# ------------------------------------------------------------------ 4. benchmarks
step "4. GPU benchmarks (timeout ${T_BENCH}s) -> $JSON"
set +e
run_limited "$T_BENCH" "$PY" bench/gpu_bench.py --out "$JSON"
bench_rc=$?
set -e

step "5. write path on CUDA (host time per Flash block; timeout 45s)"
set +e
run_limited 45 "$PY" bench/write_path.py --device cuda --quick
write_rc=$?
set -e

step "summary"
describe() { case $1 in 0) echo ok ;; 124 | 137) echo "TIMED OUT (rc $1)" ;; *) echo "FAILED (rc $1)" ;; esac; }
echo "gpu tests:  $(describe "$tests_rc")"
echo "traces:     ${traces_note:-$(describe "$traces_rc")}"
echo "benchmarks: $(describe "$bench_rc")"
echo "write path: $(describe "$write_rc")"
if [[ -f "$JSON" ]]; then
    echo "results:    $JSON"
fi
if [[ $tests_rc -ne 0 || $traces_rc -ne 0 || $bench_rc -ne 0 || $write_rc -ne 0 ]]; then
    exit 1
fi
