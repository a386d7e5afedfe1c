"""Torch's OpenMP worker pools when steps run on a background thread.

libgomp (torch's OpenMP runtime on Linux) gives each thread that starts a parallel region its own
pool of workers and keeps it until that thread exits. While the process holds more OpenMP threads
than it has CPUs, libgomp cuts the spin before a waiting worker sleeps from ~300k iterations to
100 ("throttled"), so every one of the hundreds of parallel regions in a step pays a futex wake-up.
The engine's loop is exactly such a second pool: the thread that built and warmed up the model
(usually the main one) still holds its idle workers. On 2 cores a [21, 768] x [768, 2048] linear
took ~620 us on a background thread against ~410 us on the main thread, and ~400 us on the
background thread once the main thread's pool was released (benchmarks/bench_engine.py reports
the effect on whole steps).

`release_thread_pool()` frees the calling thread's idle workers through OpenMP 5.0's
`omp_pause_resource_all(omp_pause_soft)`; libgomp pauses only the caller's pool and refuses inside a
parallel region. The thread gets a new pool the next time it runs a parallel region. Other OpenMP
runtimes (Intel's, LLVM's) pause every thread of the process and are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (found in this process's mappings), or None."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:                  # not Linux
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp"):
            lib = ctypes.CDLL(path)
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers. Returns whether a pause was done (False when
    torch does not run on libgomp, or the caller is inside a parallel region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
