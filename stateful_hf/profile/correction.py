"""The cost profile corrected online from the steps the engine runs.

A profile measured on a busy host (`cost.py`: once read 1.3-2.7 s a chunk where prefill took ~0.25 s)
would steer every later decision: LayerKV's x_min weighs Σ Cost(context) against offload time, the
eviction keys weigh Cost against idle time. So the engine times its own steps: a step whose rows are
mostly prefill or recompute (at least a chunk of them, and at least twice its decode rows) predicts
Σ_rows Cost(context) / chunk under the measured profile; the median of the last `window` such steps'
measured / predicted is the profile's error. When it strays past `tolerance` from the scale in use
(after `min_steps` steps), the profile in use becomes the measured one times that median, its `source`
saying so (`StoreStats.cost_profile`). The shape (the growth with context) stays the measured one; swap
costs are measured apart (`measure_offload_bandwidth`) and not corrected here."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cache.eviction.policy import CostProfile


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
    """The profile in use (`profile`: the measured `base` times `scale`), corrected from observed steps.
    One writer: the engine's stepping thread."""

    base: CostProfile
    block_size: int
    window: int = 32           # steps whose ratios the median is taken over
    min_steps: int = 8         # steps observed before a first correction
    tolerance: float = 1.5     # the median ratio must stray this far (either way) from `scale` to apply
    scale: float = 1.0
    observed: int = 0          # qualifying steps seen in all
    ratios: deque[float] = field(init=False)   # measured / predicted of the last `window` qualifying steps

    def __post_init__(self) -> None:
        assert self.block_size > 0 and self.window >= self.min_steps >= 1 and self.tolerance > 1, self
        self.ratios = deque(maxlen=self.window)

    @property
    def profile(self) -> CostProfile:
        if self.scale == 1.0:
            return self.base
        return CostProfile(self.base.lengths, tuple(s * self.scale for s in self.base.seconds),
                           f"{self.base.source}; corrected online x{self.scale:.3g} (median of the last "
                           f"{len(self.ratios)} prefill steps' measured / predicted)")

    def predicted(self, rows: StepRows) -> float:
        """Σ_rows Cost(context) / chunk under the measured profile: Cost is piecewise linear, so an
        entry's rows cost about rows x Cost(their mean context) / chunk."""
        return sum(n * self.base.cost(max(round(ctx), 1)) for n, ctx, _ in rows.entries) / self.block_size

    def observe(self, rows: StepRows, seconds: float) -> CostProfile | None:
        """A step that ran `rows` in `seconds`. Returns the corrected profile when the correction changes
        (the caller hands it to the store), else None."""
        prefill = rows.prefill_rows
        if prefill < self.block_size or prefill < 2 * rows.decode_rows or seconds <= 0:
            return None
        predicted = self.predicted(rows)
        if predicted <= 0:
            return None
        self.observed += 1
        self.ratios.append(seconds / predicted)
        if len(self.ratios) < self.min_steps:
            return None
        median = statistics.median(self.ratios)
        if max(median / self.scale, self.scale / median) < self.tolerance:
            return None
        self.scale = median
        return self.profile


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
