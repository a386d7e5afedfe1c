"""`ThreadSizer`: the OpenMP team of the engine's loop thread, per step, beside other processes.

Why: a step's parallel regions each end at a barrier that waits for the team's slowest thread; beside
busy processes a team thread waits for a core, and workers that spin at the barrier (`openmp.py`) take
the CPU it needs, so every region waits for the OS (docs/engine.md, "Threads on a shared host").

Rule:
- every `interval` seconds: cores others used = busy CPU time of this process's CPUs (/proc/stat)
  less this process's CPU time; the free cores set n, with hysteresis (n grows when at least
  `n + 1 - grow_margin` cores are free, shrinks below `n - shrink_margin`);
- with a `SpinSwitch` ("auto"): host busy (n < max_threads) -> a step of `shrink_rows[0] <= rows <
  shrink_rows[1]` runs on n threads, any other step on the full team with throttled waits (a waiting
  worker sleeps after a short spin, giving its core back); host free -> the full team spins;
- without one ("shrink"): every step runs on n threads, 1 <= n <= `max_threads`;
- n starts at `start` (1: busy, so a first step beside busy processes never spins);
- without /proc/stat (not Linux) n stays `start`.
The measurements behind `shrink_rows` (`benchmarks.bench_team`): docs/engine.md, "A team per step".
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from .openmp import SpinSwitch, set_thread_team


def cpu_usage(cpus: list[int]) -> tuple[float, float, float] | None:
    """(monotonic s, busy CPU s of `cpus` since boot, this process's CPU s), or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            values = list(map(int, fields[1:9]))      # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), time.process_time()


class ThreadSizer:
    """Owns the loop thread's team size. `claim()` marks the calling thread (the engine's loop) as the
    one whose steps are sized; `fit(rows)` is called by every stepping thread once a step is scheduled,
    and sizes only a claimed thread's team (steps run inline by a waiting caller keep its setting).
    `usage` (default: `cpu_usage` of the CPUs this process may run on) returns (monotonic s, busy
    CPU s of those CPUs, this process's CPU s), or None when unknown; `cpus` is how many there are."""

    def __init__(self, max_threads: int, interval: float = 0.25, grow_margin: float = 0.2,
                 shrink_margin: float = 0.4, start: int = 1,
                 usage: Callable[[], tuple[float, float, float] | None] | None = None, cpus: int | None = None,
                 switch: SpinSwitch | None = None, shrink_rows: tuple[int, int] = (16, 320)):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads, self.interval = max_threads, interval
        self.grow_margin, self.shrink_margin = grow_margin, shrink_margin
        if usage is None:
            mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
            usage, cpus = (lambda: cpu_usage(mine)), len(mine)
        self._usage, self.cpus = usage, cpus or 1
        self.current = max(1, min(start, max_threads))
        self.switch = switch          # "auto": a busy host throttles the full team's waits (but for shrink_rows)
        self.shrink_rows = shrink_rows
        self.steps_by_threads: Counter[str] = Counter()     # steps run per team ("2", "2 throttled", "1")
        self.others = 0.0                                    # cores other processes used, last window
        self._applied = threading.local()     # .claimed; .n: the team size set on that thread (a per-thread ICV)
        self._last = self._usage()

    @classmethod
    def for_option(cls, step_threads: int | str | None) -> ThreadSizer | None:
        """The sizer of `Engine(step_threads=...)`: "auto" (torch's thread count, waits throttled while
        other processes leave fewer cores free), "shrink" (the team sized to the free cores), an int (a
        fixed team), None (no sizing)."""
        if step_threads is None:
            return None
        if step_threads == "auto":
            return cls(torch.get_num_threads(), switch=SpinSwitch())
        if step_threads == "shrink":
            return cls(torch.get_num_threads())
        if isinstance(step_threads, bool) or not isinstance(step_threads, int) or step_threads < 1:
            raise ValueError(f"step_threads must be 'auto', 'shrink', an int >= 1 or None, got {step_threads!r}")
        return cls(step_threads, interval=math.inf, start=step_threads)

    def threads(self, now: bool = False) -> int:
        """The team size for the next step (re-decided at most every `interval` seconds; `now`: at once, from
        what the host did since the last decision)."""
        if self._last is None:
            return self.current
        if now or time.monotonic() - self._last[0] >= self.interval:
            sample = self._usage()
            if sample is None:                 # /proc/stat unreadable this time (fds exhausted...): keep n
                return self.current
            wall, busy, own = (b - a for a, b in zip(self._last, sample, strict=True))
            self._last = sample
            self.others = max(0.0, (busy - own) / wall) if wall > 0 else self.others
            free = self.cpus - self.others
            grow, shrink = math.floor(free + self.grow_margin), math.floor(free + self.shrink_margin)
            n = grow if grow > self.current else (shrink if shrink < self.current else self.current)
            self.current = max(1, min(self.max_threads, n))
        return self.current

    def settle(self) -> int:
        """Decide the team now and apply its waits before returning (`Engine.warm_up`, before a server answers
        /health): a new sizer starts as on a busy host (`start`), and the first step after the switch to the
        spinning team paid the change (a restarted server's first returning turn took 20-36 ms against 5-7
        with a team of 2 on the 2-core host, 3 runs in 5; none with a team of one). The host is measured over
        one `interval` at least (waiting out its rest: /proc/stat counts in 10 ms ticks). Returns the team size."""
        if self._last is not None and math.isfinite(self.interval):
            time.sleep(max(0.0, self.interval - (time.monotonic() - self._last[0])))
        n = self.threads(now=True)
        if self.switch is not None:
            self.switch.set(n < self.max_threads, wait=1.0)
        return n

    def claim(self) -> None:
        """Size the calling thread's steps from now on (`fit`)."""
        self._applied.claimed = True

    def fit(self, rows: int) -> int | None:
        """Size a claimed calling thread's team for a step of `rows` rows (with a switch: throttle the
        full team's waits while the host is busy); returns the team size, or None on another thread."""
        if not getattr(self._applied, "claimed", False):
            return None
        n = self.threads()
        throttled = False
        if self.switch is not None:
            busy = n < self.max_threads
            self.switch.set(busy)
            if not (busy and self.shrink_rows[0] <= rows < self.shrink_rows[1]):
                throttled, n = busy, self.max_threads
        if getattr(self._applied, "n", None) != n:
            # torch initialises a thread's team lazily, on its first call there, to torch.set_num_threads'
            # value (ParallelOpenMP.cpp): run that first, or it would undo this setting later
            torch.get_num_threads()
            set_thread_team(n)
            self._applied.n = n
        self.steps_by_threads[f"{n} throttled" if throttled else str(n)] += 1
        return n

    def close(self) -> None:
        """Undo the throttling (the engine stopped)."""
        if self.switch is not None:
            self.switch.close()
