"""A step's GEMM floor: this CPU's best measured time for each (rows, in, out) linear shape, over every kernel
and dtype the engine could use, whichever one it does use, so a slower engine kernel never lowers the bar.

    floor = GemmFloor()                       # candidates from CpuFeatures: capability, never vendor
    floor.measure(24, [(576, 1536), ...])     # one timed call per kernel and shape (after one warm-up)
    seconds, kernel = floor.best(24, 576, 1536)

Candidates (`GemmFloor.kernels`; the rest are listed in `skipped` with the reason):
  - matmul-fp32: `torch.matmul(x, w.T)`, float32 (always);
  - matmul-bf16: the same in bfloat16, where the CPU has bf16 units (AMX-BF16 or AVX512-BF16);
  - mkl-packed: MKL's packed sgemm on float32 (`kernels.linear`, LinearKernel.MKL_PACKED), torch built with MKL;
  - onednn-packed: oneDNN's packed bf16 matmul (LinearKernel.ONEDNN_PACKED), oneDNN and bf16 units.
`mkl-upcast` (bf16 weights through the float32 packed sgemm) is mkl-packed plus two casts: never faster, not run.
A measurement keeps the minimum over every call made in the run, so calls interleaved with the engine's steps
(the same neighbours) converge on what the CPU can do at that shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from stateful_hf.kernels.cpu_features import CpuFeatures
from stateful_hf.kernels.linear import LinearKernel, apply, pack

PACK_ROWS = 256          # the row hint packed copies are made with (the engine's max_batch_tokens default)


class GemmFloor:
    """Best seconds per (threads, kernel, rows, in, out) seen in the run; `best` takes the minimum over kernels."""

    def __init__(self, features: CpuFeatures | None = None):
        self.features = features if features is not None else CpuFeatures.detect()
        f = self.features
        self.kernels: list[str] = ["matmul-fp32"]
        self.skipped: dict[str, str] = {}
        for name, ok, why in (("matmul-bf16", f.bf16_units, "no bf16 units (AMX-BF16 or AVX512-BF16)"),
                              ("mkl-packed", f.mkl, "torch without MKL"),
                              ("onednn-packed", f.onednn and f.bf16_units, "needs oneDNN and bf16 units")):
            (self.kernels.append(name) if ok else self.skipped.__setitem__(name, why))
        self.skipped["mkl-upcast"] = "mkl-packed plus two casts: never faster than mkl-packed"
        self._weights: dict[tuple[int, int], dict[str, tuple]] = {}
        self._rows: dict[tuple[int, int, str], torch.Tensor] = {}
        self.times: dict[tuple[int, str, int, int, int], float] = {}

    def _call(self, kernel: str, m: int, k: int, n: int) -> Callable[[], torch.Tensor]:
        """The one GEMM of `kernel` at [m, k] x [k, n] (operands made once per shape)."""
        if (k, n) not in self._weights:
            g = torch.Generator().manual_seed(k * 100003 + n)
            w = torch.randn(n, k, generator=g)
            wb = w.to(torch.bfloat16)
            ops: dict[str, tuple] = {"matmul-fp32": (w,), "matmul-bf16": (wb,)}
            if "mkl-packed" in self.kernels:
                ops["mkl-packed"] = (pack(w, LinearKernel.MKL_PACKED, PACK_ROWS), w)
            if "onednn-packed" in self.kernels:
                ops["onednn-packed"] = (pack(wb, LinearKernel.ONEDNN_PACKED, PACK_ROWS), wb)
            self._weights[k, n] = ops
        dtype = torch.bfloat16 if kernel in ("matmul-bf16", "onednn-packed") else torch.float32
        if (m, k, dtype) not in self._rows:
            self._rows[m, k, dtype] = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(dtype)
        x, ops = self._rows[m, k, dtype], self._weights[k, n][kernel]
        if kernel.startswith("matmul"):
            wt = ops[0].t()
            return lambda: torch.matmul(x, wt)
        packed, w = ops
        lk = LinearKernel.MKL_PACKED if kernel == "mkl-packed" else LinearKernel.ONEDNN_PACKED
        return lambda: apply(x, packed, w, None, lk)

    def measure(self, m: int, shapes: Iterable[tuple[int, int]]) -> None:
        """One timed call of every kernel at each (in, out) shape with `m` rows, at this thread's torch threads;
        a first sight of a (threads, kernel, m, in, out) gets an untimed warm-up call first."""
        if m <= 0:
            return
        threads = torch.get_num_threads()
        with torch.inference_mode():
            for k, n in dict.fromkeys(shapes):
                for kernel in self.kernels:
                    key = (threads, kernel, m, k, n)
                    fn = self._call(kernel, m, k, n)
                    if key not in self.times:
                        fn()
                    t0 = time.perf_counter()
                    fn()
                    t = time.perf_counter() - t0
                    self.times[key] = min(t, self.times.get(key, float("inf")))

    def best(self, m: int, k: int, n: int, threads: int | None = None) -> tuple[float, str]:
        """(seconds, kernel) of the fastest kernel measured at this shape and thread count (this thread's now)."""
        threads = torch.get_num_threads() if threads is None else threads
        got = [(self.times[threads, kernel, m, k, n], kernel) for kernel in self.kernels
               if (threads, kernel, m, k, n) in self.times]
        if not got:
            raise KeyError(f"no GEMM measured at {m} x {k} x {n} on {threads} threads")
        return min(got)

    def describe(self) -> dict:
        """The CPU and the candidates, for a report."""
        return {"cpu": self.features.describe(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "kernels": list(self.kernels), "skipped": dict(self.skipped)}
