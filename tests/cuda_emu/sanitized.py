"""Traces of every kernel (or one positive control) in the AddressSanitizer + UBSan build.

The sanitizer runtime must be the first library of the process, so tests/test_cuda_emu.py
starts this module in a subprocess::

    LD_PRELOAD=$(g++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \\
        python -m cuda_emu.sanitized --traces 6            # (from tests/) exit 0: all clean
    ... python -m cuda_emu.sanitized --control shared_layout_overflow   # must die with a report

A sanitizer report aborts the process (``-fno-sanitize-recover=all``); a trace that
merely differs from its twin exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from tiered_kv.kernels import cuda_ops

from . import EmuLauncher, ORDERS
from .controls import CONTROLS, write_control
from .traces import KERNELS, make_traces, run_trace


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=int, default=6, help="traces per kernel family (the first of the CI set)")
    ap.add_argument("--control", choices=sorted(CONTROLS), help="run this positive control instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # small tensors: one thread is faster (see tests/test_cuda_emu.py)
    orders = list(ORDERS)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {}
        families = list(KERNELS)
        if args.control:
            name, path = write_control(args.control, Path(tmp))
            sources[name] = path
            families = [CONTROLS[args.control].family]
        done = 0
        for family in families:
            for trace in make_traces(family, args.traces):
                if trace.family == "hisparse" and trace.params["N"] > 4096:
                    continue  # N = 16,384 is slow under ASan; the plain build runs it
                launcher = EmuLauncher(order=orders[trace.index % 3], seed=trace.seed, sanitize=True,
                                       sources=sources)
                with cuda_ops.launcher(launcher):
                    try:
                        run_trace(trace, "cpu")
                    except Exception as exc:
                        print(f"sanitized: {type(exc).__name__}: {exc}", flush=True)
                        return 1
                done += 1
    print(f"sanitized: {done} traces clean under ASan+UBSan", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
