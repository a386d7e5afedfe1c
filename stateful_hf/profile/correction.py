"""The cost profile corrected online from the steps the engine runs and the swap-ins the store makes.

A profile measured on a busy host (`cost.py`: once read 1.3-2.7 s a chunk where prefill took ~0.25 s)
would steer every later decision: LayerKV's x_min weighs Σ Cost(context) against offload time, the
eviction keys weigh Cost against idle time. So the engine times its own steps: a step whose rows are
mostly prefill or recompute (at least a chunk of them, and at least twice its decode rows) predicts
Σ_rows Cost(context) / chunk under the measured profile; the median of the last `window` such steps'
measured / predicted is the profile's error. When it strays past `tolerance` from the scale in use
(after `min_steps` steps), the profile in use becomes the measured one times that median, its `source`
saying so (`StoreStats.cost_profile`). The shape (the growth with context) stays the measured one.

Swap-in costs (seconds a chunk brought up to the device from the host or the disk; `CostProfile.swap_in`)
are measured from the store's moves (`observe_move`, a `MoveLedger` listener): a batch up to the device
of at least `min_swap_chunks` chunks whose seconds ran until its copy landed (`MoveBatch.landed`: a
synchronous copy on the CPU; on CUDA or under the async emulator only a move that waits for its copy,
e.g. a hint's prefetch, never a step's swap-in, which the step's layers wait on later) gives one sample
per chunk; the median of a tier's last `window` samples (after `min_steps`) becomes its swap-in cost
when none is known or when it strays past `tolerance` from the one in use. Moves may be recorded on
any thread (under the store lock): a lock guards the swap state, and the next `observe` hands the
changed profile to the engine (listeners must not call into the store)."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cache.eviction.policy import CostProfile
from ..cache.movement.moves import MoveBatch

SWAP_TIERS = ("host", "disk")      # where chunks come up to the device from, with a swap-in cost each


@dataclass(frozen=True, slots=True)
class StepRows:
    """One step's rows for the correction: per entry (rows, mean context they attend to, decode row)."""

    entries: tuple[tuple[int, float, bool], ...]

    @property
    def prefill_rows(self) -> int:
        return sum(n for n, _, decode in self.entries if not decode)

    @property
    def decode_rows(self) -> int:
        return sum(n for n, _, decode in self.entries if decode)


@dataclass(slots=True)
class CostCorrection:
    """The profile in use (`profile`: the measured `base` times `scale`, with the swap-in costs measured
    online), corrected from observed steps (the engine's stepping thread) and moves (any thread)."""

    base: CostProfile
    block_size: int
    window: int = 32           # samples whose median is taken (steps' ratios; a tier's swap-ins per chunk)
    min_steps: int = 8         # samples observed before a first correction
    tolerance: float = 1.5     # the median must stray this far (either way) from the value in use to apply
    min_swap_chunks: int = 4   # a move up of fewer chunks is no evidence (its fixed costs dominate)
    scale: float = 1.0
    observed: int = 0          # qualifying steps seen in all
    ratios: deque[float] = field(init=False)   # measured / predicted of the last `window` qualifying steps
    swap_in: dict[str, float] = field(init=False)            # tier -> seconds a chunk in use (measured ones)
    swap_samples: dict[str, deque[float]] = field(init=False)   # tier -> seconds a chunk of its last moves
    _changed: bool = field(init=False, default=False)        # the profile changed since `observe` last said
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.window >= self.min_steps >= 1 and self.tolerance > 1, self
        assert self.min_swap_chunks >= 1, self
        self.ratios = deque(maxlen=self.window)
        self.swap_in = dict(self.base.swap_in)
        self.swap_samples = {t: deque(maxlen=self.window) for t in SWAP_TIERS}

    @property
    def profile(self) -> CostProfile:
        with self._lock:
            swap = tuple((t, self.swap_in[t]) for t in SWAP_TIERS if t in self.swap_in)
            if self.scale == 1.0 and swap == self.base.swap_in:
                return self.base
            source = self.base.source
            if self.scale != 1.0:
                source += (f"; corrected online x{self.scale:.3g} (median of the last {len(self.ratios)} prefill "
                           "steps' measured / predicted)")
            for t, sec in swap:
                if (t, sec) not in self.base.swap_in:
                    source += (f"; swap-in from {t} {sec:.3g} s a chunk, measured online (median of the last "
                               f"{len(self.swap_samples[t])} moves' seconds a chunk)")
            seconds = tuple(x * self.scale for x in self.base.seconds)
            return CostProfile(self.base.lengths, seconds, source, swap)

    def _strays(self, measured: float, in_use: float) -> bool:
        """Whether `measured` is `tolerance` or more away from `in_use`, either way."""
        return max(measured / in_use, in_use / measured) >= self.tolerance

    def predicted(self, rows: StepRows) -> float:
        """Σ_rows Cost(context) / chunk under the measured profile: Cost is piecewise linear, so an
        entry's rows cost about rows x Cost(their mean context) / chunk."""
        return sum(n * self.base.cost(max(round(ctx), 1)) for n, ctx, _ in rows.entries) / self.block_size

    def observe(self, rows: StepRows, seconds: float) -> CostProfile | None:
        """A step that ran `rows` in `seconds`. Returns the corrected profile when it changed since the
        last call (by this step, or by moves observed since), for the caller to hand to the store; else None."""
        prefill = rows.prefill_rows
        predicted = self.predicted(rows) if prefill >= self.block_size and prefill >= 2 * rows.decode_rows \
            and seconds > 0 else 0.0
        if predicted > 0:
            self.observed += 1
            self.ratios.append(seconds / predicted)
            median = statistics.median(self.ratios)
            if len(self.ratios) >= self.min_steps and self._strays(median, self.scale):
                with self._lock:
                    self.scale, self._changed = median, True
        with self._lock:
            changed, self._changed = self._changed, False
        return self.profile if changed else None

    def observe_move(self, batch: MoveBatch) -> None:
        """A move batch (`MoveLedger` listener; store lock held, any thread): one up to the device from a
        swap tier, of at least `min_swap_chunks` chunks, whose seconds ran until its copy landed, is a sample."""
        if batch.dst != "device" or batch.src not in SWAP_TIERS or not batch.landed \
                or batch.chunks < self.min_swap_chunks or batch.seconds <= 0:
            return
        with self._lock:
            samples = self.swap_samples[batch.src]
            samples.append(batch.seconds / batch.chunks)
            if len(samples) < self.min_steps:
                return
            median, now = statistics.median(samples), self.swap_in.get(batch.src)
            if now is None or self._strays(median, now):
                self.swap_in[batch.src], self._changed = median, True


def step_rows(entries: Sequence[tuple[Sequence[int], int, int, bool]]) -> StepRows:
    """From (recomputed positions, the new rows' first position, new rows, whether they decode) per entry;
    a row at position p attends to p + 1 tokens."""
    out = []
    for recompute, start, new, decode in entries:
        if recompute:
            out.append((len(recompute), sum(recompute) / len(recompute) + 1, False))
        if new:
            out.append((new, start + (new + 1) / 2, decode))
    return StepRows(tuple(out))
