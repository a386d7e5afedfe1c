"""Which paged-attention backend attends each step: one for every step, or, for `attn_backend="auto"` on the CPU,
the C++ kernel (`cpu_backend.py`, blocks read in place) for sub-requests of few query rows (decodes) and torch's
SDPA (`torch_batched.py`: a gather, then GEMM-shaped attention) for longer ones (prefills), where measurement at
store creation says so; a step with both is a SPLIT step (`kernel_plan.SplitPlan`), each row computed by one.

Why: a decode row reads its session's whole K/V once; the C++ kernel reads it in place where torch gathers it
first, and wins (docs/cpu.md). A prefill's rows share their keys, where SDPA's blocked GEMMs win. Both are exact in
float32 (the tokens of stateless `generate`); bitwise logits are promised only under batch invariance, which gives
every step to the C++ kernel.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import cpu_backend
from .batch import PagedBatch
from .kernel_plan import SPLIT
from .torch_batched import TorchPlan

logger = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64, 256)    # query rows of each sub-request of the steps measured (decode .. a prefill chunk)
QUERY_ROWS = 128              # a measured step's rows: 8 decodes, 8 x 16, 2 x 64, then 1 x 256
CONTEXT = 512                 # tokens of context each sub-request attends to
MARGIN = 0.9                  # the C++ kernel is taken for a shape only if at most this share of torch's time
REPEATS = 5


@dataclass(frozen=True, slots=True)
class StepBackends:
    """`short` (when set) attends the sub-requests of at most `short_rows` query rows, `long` the others.
    `measured`: (rows a sub-request, torch seconds, C++ seconds) of one step's attention, per shape measured."""

    long: str
    short: str | None = None
    short_rows: int = 0
    measured: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self) -> None:
        assert (self.short is None) == (self.short_rows == 0), "a short backend needs its row bound, and only it"
        assert self.short != self.long, "a rule picks between two backends"

    def for_step(self, runs: Sequence[int]) -> str:
        """The backend of a step whose sub-requests compute `runs` query rows each: `long`, `short`, or SPLIT when
        it has runs of both kinds."""
        if self.short is None:
            return self.long
        short = sum(r <= self.short_rows for r in runs)
        return self.short if short == len(runs) else self.long if short == 0 else SPLIT

    def describe(self) -> str:
        if self.short is None:
            return self.long
        return f"{self.short} for sub-requests of <= {self.short_rows} query rows, {self.long} for longer"


def _batch(rows: int, block_size: int) -> PagedBatch:
    """Sub-requests of `rows` new rows each over CONTEXT tokens of context, QUERY_ROWS rows in all (at least one,
    at most 8 sub-requests)."""
    runs = [rows] * max(1, min(8, QUERY_ROWS // rows))
    blocks = -(-(CONTEXT + rows) // block_size)
    cu = [0]
    pos: list[int] = []
    for r in runs:
        pos += range(CONTEXT, CONTEXT + r)
        cu.append(len(pos))
    table = torch.arange(len(runs) * blocks, dtype=torch.int32).reshape(len(runs), blocks)
    return PagedBatch(torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64),
                      torch.tensor([CONTEXT + r for r in runs], dtype=torch.int32), table)


def _step_seconds(plan_type, batch: PagedBatch, block_size: int, query, key, value, layers: int) -> float:
    """One step's attention: its plan, then `layers` calls (the fastest of REPEATS, scaled)."""
    start = time.perf_counter()
    plan = plan_type(batch, block_size)
    plan.run(query, key, value, query.shape[-1] ** -0.5)
    made = time.perf_counter() - start
    runs = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        plan.run(query, key, value, query.shape[-1] ** -0.5)
        runs.append(time.perf_counter() - start)
    return made + (layers - 1) * min(runs)


@functools.cache
def measure(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, layers: int,
            threads: int) -> StepBackends:
    """`attn_backend="auto"` on the CPU for this attention geometry: the C++ kernel for sub-requests of up to the
    longest measured run at which it takes at most MARGIN of torch's time (and at every shorter one), torch for
    longer ones; the C++ kernel for all if it wins at every shape, torch alone if it loses at decode or is not built.
    Once per geometry and thread count in a process (~0.2-0.5 s)."""
    if cpu_backend.supports(dtype, head_dim, block_size) is not None or not cpu_backend.available("cpu"):
        return StepBackends("torch")
    gen = torch.Generator().manual_seed(0)
    blocks = 8 * -(-(CONTEXT + max(ROWS)) // block_size)
    key, value = (torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    measured = []
    for rows in (ROWS[0], *ROWS):            # the first shape twice: its first round warms both backends up
        batch = _batch(rows, block_size)
        query = torch.randn(batch.q_pos.numel(), num_heads, head_dim, generator=gen).to(dtype)
        torch_s = _step_seconds(TorchPlan, batch, block_size, query, key, value, layers)
        cpu_s = _step_seconds(cpu_backend.CpuPlan, batch, block_size, query, key, value, layers)
        measured.append((rows, torch_s, cpu_s))
    measured = measured[1:]
    wins = [cpu_s <= MARGIN * torch_s for _, torch_s, cpu_s in measured]
    short = len(wins) if all(wins) else wins.index(False)
    if short == len(ROWS):
        rule = StepBackends("cpu", measured=tuple(measured))
    elif short == 0:
        rule = StepBackends("torch", measured=tuple(measured))
    else:
        rule = StepBackends("torch", "cpu", ROWS[short - 1], tuple(measured))
    logger.info("attn_backend='auto' on the CPU (%d threads): %s; measured (rows, torch s, C++ s) a step: %s",
                threads, rule.describe(), [(r, round(t, 5), round(c, 5)) for r, t, c in measured])
    return rule
