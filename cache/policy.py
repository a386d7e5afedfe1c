"""Which chunks leave the device first: Pensieve's retention value, or plain LRU for comparison.

Retention value of chunk k of a session idle for T seconds: V = Cost(l) / T with l = (k + 1) * chunk
(the context the chunk attends to when recomputed). Evict in ascending V: idler sessions first and,
inside a session, leading chunks first (cheaper to recompute).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .session import ChunkState, Session


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Cost(l) in seconds of recomputing one chunk attending to l tokens, from measurements at
    increasing context lengths `lengths` (powers of two), interpolated linearly, extrapolated
    with the last slope."""

    lengths: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    seconds: tuple[float, ...] = (1.0, 1.03, 1.09, 1.19, 1.38, 1.77, 2.53, 4.06, 7.13)  # shape: c + a*l

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.seconds) or len(self.lengths) < 2:
            raise ValueError("CostProfile needs >= 2 (length, seconds) points of equal count")
        if list(self.lengths) != sorted(self.lengths):
            raise ValueError("CostProfile.lengths must increase")

    def cost(self, context: int) -> float:
        xs, ys = self.lengths, self.seconds
        i = min(max(bisect.bisect_left(xs, context), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (context - x0) / (x1 - x0)


class EvictionPolicy:
    """Orders device chunks of candidate sessions for eviction. Reads sessions, never mutates them."""

    name = "base"

    def order(self, sessions: Iterable[Session], block_size: int, now: float) -> Iterator[tuple[Session, int]]:
        raise NotImplementedError


class RetentionPolicy(EvictionPolicy):
    name = "pensieve"

    def __init__(self, profile: CostProfile | None = None):
        self.profile = profile or CostProfile()

    def order(self, sessions, block_size, now):
        ranked = []
        for s in sessions:
            idle = max(now - s.last_active, 1e-6)
            for k, c in enumerate(s.chunks):
                if c.state is ChunkState.DEVICE:
                    ranked.append((self.profile.cost((k + 1) * block_size) / idle, s.session_id, k, s))
        ranked.sort(key=lambda r: r[:3])
        return ((s, k) for _, _, k, s in ranked)


class LRUPolicy(EvictionPolicy):
    """Least recently active session first, its chunks front to back."""

    name = "lru"

    def order(self, sessions, block_size, now):
        for s in sorted(sessions, key=lambda s: s.last_active):
            for k, c in enumerate(s.chunks):
                if c.state is ChunkState.DEVICE:
                    yield s, k
