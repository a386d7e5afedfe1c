"""Torch's OpenMP worker pools when steps run on a background thread, through threadpoolctl.

libgomp (torch's OpenMP runtime on Linux) gives each thread that starts a parallel region its own
pool of workers and keeps it until that thread exits. While the process holds more OpenMP threads
than it has CPUs, libgomp cuts the spin before a waiting worker sleeps from ~300k iterations to
100 ("throttled"), so every one of the hundreds of parallel regions in a step pays a futex wake-up.
The engine's loop is exactly such a second pool: the thread that built and warmed up the model
(usually the main one) still holds its idle workers.

`release_thread_pool()` frees the calling thread's idle workers through OpenMP 5.0's
`omp_pause_resource_all(omp_pause_soft)`; libgomp pauses only the caller's pool and refuses inside a
parallel region. The thread gets a new pool the next time it runs a parallel region. Other OpenMP
runtimes (Intel's, LLVM's) pause every thread of the process and are left alone.

`set_thread_team(n)` sets the OpenMP team size of the calling thread only (`omp_set_num_threads`
is a per-thread setting in libgomp; torch's parallel ops and its GEMMs size their teams from it):
the engine's loop sizes its own team to the free cores (`thread_sizing.py`) without touching the
threads of the process that called it.

threadpoolctl finds the OpenMP libraries in the process and sets team sizes; the pause, which it does not
offer, is called on torch's own libgomp. Another package may bring its own copy (sentencepiece's wheel vendors
one, `sentencepiece.libs/libgomp-*.so`), listed before torch's: pausing that one would free none of torch's
workers, so the copy in torch's package directory comes first (`_torch_first`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch
from threadpoolctl import ThreadpoolController

OMP_PAUSE_SOFT = 1


def _torch_first(filepaths: list[str], torch_dir: str) -> list[int]:
    """Indices of `filepaths` (OpenMP libraries) in the order to use them: libgomp under `torch_dir` (torch's own),
    then other libgomps, then the rest; stable within each."""
    torch_dir = os.path.join(os.path.realpath(torch_dir), "")
    return sorted(range(len(filepaths)), key=lambda i: ("libgomp" not in filepaths[i],
                                                       not os.path.realpath(filepaths[i]).startswith(torch_dir)))


@functools.cache
def _openmp():
    """threadpoolctl's controllers of the OpenMP libraries in this process (torch's libgomp first), or None
    when torch's parallel backend is not OpenMP."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    controllers = ThreadpoolController().select(user_api="openmp").lib_controllers
    order = _torch_first([c.filepath for c in controllers], os.path.dirname(torch.__file__))
    return [controllers[i] for i in order] or None


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded, with `omp_pause_resource_all`, as a ctypes library; or None."""
    libs = _openmp()
    if not libs or "libgomp" not in libs[0].filepath:
        return None
    fn = getattr(libs[0].dynlib, "omp_pause_resource_all", None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return libs[0].dynlib


def can_release() -> bool:
    """Whether `release_thread_pool` can work here (torch runs on a libgomp with the OpenMP 5.0 pause)."""
    return _libgomp() is not None


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers. Returns whether a pause was done (False when
    torch does not run on libgomp, or the caller is inside a parallel region)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


def set_thread_team(n: int) -> bool:
    """Parallel regions the calling thread starts from now on use `n` threads (itself included).
    Other threads keep their own setting. Returns False when torch does not run on OpenMP."""
    libs = _openmp()
    if not libs:
        return False
    for lib in libs:
        lib.set_num_threads(n)
    return True


class SpinSwitch:
    """Switches how the OpenMP workers of this process wait at a barrier, at run time: spinning
    (~300k iterations before sleeping: fastest on cores the process has to itself) or throttled
    (100 iterations, then a futex sleep: a waiting worker gives its core back at once, and the OS
    wakes it promptly as a thread that slept). libgomp throttles every waiter while the process holds
    more OpenMP threads than CPUs; this switch holds or frees an idle pool (a "ballast") on a parked
    thread of its own to cross that line. Owns that thread; `close()` ends it."""

    def __init__(self):
        self._cv = threading.Condition()
        self._want: bool | None = None          # True: throttled (ballast held); None: nothing asked
        self._asked = self._applied = 0         # requests made, requests applied (the switch's thread's)
        self._closing = False
        self.throttled = False
        self._thread: threading.Thread | None = None

    def set(self, throttled: bool, wait: float = 0.05) -> None:
        """Ask for throttled (True) or spinning (False) waits, applied on the switch's thread (the ballast's pool
        is that thread's); waits up to `wait` seconds until it is, so the step that asked runs in the mode it
        asked for, not beside the switch taking or freeing its pool (a restarted server's first turn ran 17-20
        ms instead of 5-7 while the warm-up's throttle was being undone beside it)."""
        if throttled == self.throttled and self._want is None:
            return
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stateful-hf-omp-ballast", daemon=True)
                self._thread.start()
            self._want = throttled
            self._asked += 1
            asked = self._asked
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._applied >= asked, timeout=wait)

    def close(self) -> None:
        """Free the ballast (spinning waits again) and end the switch's thread."""
        with self._cv:
            self._closing, self._want = True, False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _run(self) -> None:
        ballast = torch.ones(512, 512)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._want is not None)
                want, self._want = self._want, None
                closing, asked = self._closing, self._asked
            if want and not self.throttled:
                ballast @ ballast                 # a parallel region: this thread now holds a pool
                self.throttled = True
            elif not want and self.throttled:
                self.throttled = not release_thread_pool()
            with self._cv:
                self._applied = asked
                self._cv.notify_all()             # applied: a `set` waiting for it goes on
            if closing:
                return
