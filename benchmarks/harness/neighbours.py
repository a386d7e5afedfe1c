"""Processes run beside a benchmark, as a shared host has them: `--neighbour` of bench_engine and
bench_threads. Each neighbour is a fresh interpreter (subprocess: fork + exec, never a fork of this
process after torch started), alive for the `Neighbours` context; every system runs beside the same set.

Specs (combine with "+"): "quiet" (nothing), "busy:N" (N processes in `while True: pass`),
"bursty" (a second inference server: bursts of 2-thread torch matmuls shaped like a 100M model's
linear layers on a few rows, ~20-120 ms long, then ~20-120 ms of sleep, a fixed random schedule),
"bursty:N" (N of those). Example: "busy:1+bursty".
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

# Each neighbour exits once its parent is gone (a killed benchmark leaves no busy process behind).
_BUSY = "import os\nwhile os.getppid() == {parent}: pass"

# The second server: 2 OpenMP threads (as a torch process on this 2-core host has by default), bursts
# of [16, 768] x [768, 2048] matmuls (a decode batch through a 768-wide model's MLP), then sleep.
_BURSTY = """
import os, random, time, torch
torch.set_num_threads(2)
rng = random.Random({seed})
x, w = torch.randn(16, 768), torch.randn(2048, 768)
while os.getppid() == {parent}:
    end = time.perf_counter() + rng.uniform(0.02, 0.12)
    while time.perf_counter() < end:
        for _ in range(8):
            torch.nn.functional.linear(x, w)
    time.sleep(rng.uniform(0.02, 0.12))
"""


def parse(spec: str) -> list[tuple[str, int]]:
    """[(kind, count)] of a spec; raises ValueError for an unknown one."""
    out = []
    for part in filter(None, spec.strip().split("+")):
        kind, colon, n = part.partition(":")
        if kind == "quiet" and not colon:
            continue
        if kind not in ("busy", "bursty") or (colon and not n.isdigit()):
            raise ValueError(f"unknown neighbour {part!r}: use quiet, busy:N, bursty or bursty:N (joined by '+')")
        out.append((kind, int(n) if n else 1))
    return out


class Neighbours:
    """`with Neighbours("busy:2"):` runs the neighbours for the block's duration."""

    def __init__(self, spec: str):
        self.spec, self.kinds = spec, parse(spec)
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Neighbours:
        env = dict(os.environ, OMP_NUM_THREADS="2")
        for kind, n in self.kinds:
            for i in range(n):
                code = (_BUSY if kind == "busy" else _BURSTY).format(seed=len(self.procs) + i, parent=os.getpid())
                self.procs.append(subprocess.Popen([sys.executable, "-c", code], env=env,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if any(kind == "bursty" for kind, _ in self.kinds):
            time.sleep(3.0)          # let the torch neighbours import and start their bursts
        elif self.procs:
            time.sleep(0.2)
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"neighbour process exited with {p.returncode} ({self.spec})")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []
