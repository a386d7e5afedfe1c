"""Will an idle conversation come back? An online estimate from the gaps the store has seen.

A conversation's idle period ends when its next turn starts (a *gap* the store observes) or never
(the conversation is over; the server is not told). The store cannot tell an unfinished idle period
from a finished one, so every idle period still open is a right-censored observation: the gap, if
any, is longer than the idle time so far. The Kaplan-Meier estimate over observed gaps and open idle
periods gives S(t) = P(gap > t), where a conversation that never returns has an infinite gap. Past
the longest gap ever observed the data say nothing, so that mass is taken as "never returns":

    P(returns | idle T) = (S(T) - S_end) / S(T),   S_end = S(longest observed gap)

It is non-increasing in T (S is), 0 for a conversation idle longer than any gap seen, and it is the
same function for every conversation: one population, no per-conversation features.

Invariant: gaps are >= 0 and at most `max_gaps` of the most recent are kept.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable


class ReturnEstimator:
    """Observed gaps (`observe`), then `fit(open_idle_times)` before ranking; `p_return(idle)` reads
    the fitted curve. Before the first gap is observed `fitted` is False and there is no estimate."""

    __slots__ = ("_gaps", "_times", "_surv", "_end")

    def __init__(self, max_gaps: int = 4096):
        if max_gaps < 1:
            raise ValueError(f"max_gaps must be >= 1, got {max_gaps}")
        self._gaps: deque[float] = deque(maxlen=max_gaps)
        self._times: list[float] = []     # distinct observed gap lengths, increasing
        self._surv: list[float] = []      # S just after each of them (Kaplan-Meier), non-increasing
        self._end = 1.0

    def observe(self, gap: float) -> None:
        """A conversation came back after `gap` seconds idle."""
        self._gaps.append(max(float(gap), 0.0))

    @property
    def num_gaps(self) -> int:
        return len(self._gaps)

    @property
    def fitted(self) -> bool:
        return bool(self._times)

    def fit(self, open_idle: Iterable[float]) -> None:
        """Kaplan-Meier over the observed gaps (events) and the idle times of conversations idle now
        (censored: still waiting, possibly forever). A censored time equal to a gap counts as at
        risk at that gap."""
        obs = sorted([(g, 0) for g in self._gaps] + [(max(float(c), 0.0), 1) for c in open_idle])
        times, surv, s, i, n = [], [], 1.0, 0, len(obs)
        while i < n:
            t, j, events = obs[i][0], i, 0
            while j < n and obs[j][0] == t:
                events += obs[j][1] == 0
                j += 1
            if events:
                s *= 1.0 - events / (n - i)         # n - i observations are still at risk at t
                times.append(t)
                surv.append(s)
            i = j
        self._times, self._surv = times, surv
        self._end = surv[-1] if surv else 1.0

    def survival(self, t: float) -> float:
        """S(t) = P(gap > t) of the last fit (1 before the first observed gap)."""
        i = bisect.bisect_right(self._times, t)
        return 1.0 if i == 0 else self._surv[i - 1]

    def p_return(self, idle: float) -> float:
        """P(the conversation starts another turn | idle for `idle` seconds) of the last fit; 0 when
        idle at least as long as the longest gap observed (or before any fit)."""
        s = self.survival(idle)
        return (s - self._end) / s if s > 0.0 else 0.0
