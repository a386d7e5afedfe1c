"""Which chunks move down first: Pensieve's retention value, or plain LRU for comparison.

Retention value of chunk k of a session idle for T seconds: V = Cost(l) / T with l = (k + 1) * chunk
(the context the chunk attends to when recomputed). Move down in ascending V: idler sessions first
and, inside a session, leading chunks first (cheaper to recompute). The same order decides
device -> host, host -> disk and what is dropped.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .session import Session


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Cost(l): seconds to recompute one chunk attending to l tokens, measured at increasing lengths
    (powers of two) and interpolated linearly; extrapolated with the last slope. Measurements are
    made non-decreasing (the cost of attention grows with l; noise must not reorder chunks)."""

    lengths: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    seconds: tuple[float, ...] = (1.0, 1.03, 1.09, 1.19, 1.38, 1.77, 2.53, 4.06, 7.13)  # c + a*l shape

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.seconds) or len(self.lengths) < 2:
            raise ValueError("CostProfile needs >= 2 (length, seconds) points of equal count")
        if list(self.lengths) != sorted(set(self.lengths)):
            raise ValueError("CostProfile.lengths must strictly increase")
        monotone, top = [], 0.0
        for s in self.seconds:
            top = max(top, float(s))
            monotone.append(top)
        object.__setattr__(self, "seconds", tuple(monotone))

    def cost(self, context: int) -> float:
        xs, ys = self.lengths, self.seconds
        i = min(max(bisect.bisect_left(xs, context), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (context - x0) / (x1 - x0), ys[0] * 1e-3)


class EvictionPolicy:
    """Ranks chunks for moving down: smaller key first. Reads sessions, never mutates them."""

    name = "base"

    def key(self, session: Session, k: int, block_size: int, now: float) -> tuple:
        raise NotImplementedError


class RetentionPolicy(EvictionPolicy):
    name = "pensieve"

    def __init__(self, profile: CostProfile | None = None):
        self.profile = profile or CostProfile()

    def key(self, session, k, block_size, now):
        idle = max(now - session.last_active, 1e-6)
        return (self.profile.cost((k + 1) * block_size) / idle, session.session_id, k)


class LRUPolicy(EvictionPolicy):
    """Least recently active session first, its chunks front to back."""

    name = "lru"

    def key(self, session, k, block_size, now):
        return (session.last_active, session.session_id, k)
