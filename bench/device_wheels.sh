#!/usr/bin/env bash
# Wheels for the GPU machine, which has torch, CuPy, pytest, hypothesis and xxhash but not
# the storage packages (and no network): downloads them here into .whl/ (git-ignored), for
# the device tool's `carry: [".whl"]`. bench/gpu_check.sh installs .whl/*.whl into a
# temporary --target folder on PYTHONPATH when .whl/ exists, so every gpu-marked test
# (disk resume to CUDA included) collects there.
#
#   bash bench/device_wheels.sh            # then run bench/gpu_check.sh with .whl carried
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PKGS=(lmdb==3.0.0 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
      typing_extensions packaging pyyaml)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PKGS[@]}"
ls -la .whl
