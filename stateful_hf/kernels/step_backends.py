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
from .blocks import blocks_for
from .kernel_plan import SPLIT, SplitPlan
from .torch_batched import TorchPlan

logger = logging.getLogger(__name__)

ROWS = (1, 4, 16, 64, 256)    # rows of the long run of the steps measured (a decode step .. a prefill chunk)
DECODES = 8                   # a measured step: this many decodes, one of them the long run
CONTEXT = 512                 # tokens of context each sub-request attends to
MARGIN = 0.9                  # torch takes a run from the C++ kernel only in at most this share of its time
REPEATS = 5


@dataclass(frozen=True, slots=True)
class StepBackends:
    """`short` (when set) attends the sub-requests of at most `short_rows` query rows, `long` the others.
    `measured`: per step measured, (rows of its long run, seconds of its attention with torch attending that run,
    with the C++ kernel attending every row): `measure`."""

    long: str
    short: str | None = None
    short_rows: int = 0
    measured: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self) -> None:
        assert (self.short is None) == (self.short_rows == 0), "a short backend needs its row bound, and only it"
        assert self.short != self.long, "a rule picks between two backends"
        assert self.short is None or (self.short, self.long) == ("cpu", "torch"), \
            "a split step (`SplitPlan`) gives the short runs to the C++ kernel and the others to torch, only"

    def for_step(self, runs: Sequence[int]) -> str:
        """The backend of a step whose sub-requests compute `runs` query rows each: `long`, `short`, or SPLIT when
        it has runs of both kinds."""
        if self.short is None:
            return self.long
        runs = [r for r in runs if r]            # a sub-request of no query rows has no output row on either side
        short = sum(r <= self.short_rows for r in runs)
        return self.short if short == len(runs) else self.long if short == 0 else SPLIT

    def describe(self) -> str:
        if self.short is None:
            return self.long
        return f"{self.short} for sub-requests of <= {self.short_rows} query rows, {self.long} for longer"


def _batch(rows: int, block_size: int) -> PagedBatch:
    """DECODES sub-requests over CONTEXT tokens of context each: the first computes `rows` new rows, the others one."""
    runs = [rows] + [1] * (DECODES - 1)
    blocks = blocks_for(CONTEXT + rows, block_size)
    cu = [0]
    pos: list[int] = []
    for r in runs:
        pos += range(CONTEXT, CONTEXT + r)
        cu.append(len(pos))
    table = torch.arange(len(runs) * blocks, dtype=torch.int32).reshape(len(runs), blocks)
    return PagedBatch(torch.tensor(cu, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64),
                      torch.tensor([CONTEXT + r for r in runs], dtype=torch.int32), table)


def _step_seconds(make_plans, query, key, value, layers: int) -> list[float]:
    """Per plan maker, one step's attention: its plan and first call, then `layers` - 1 calls at the fastest of
    REPEATS. The makers' repeats alternate, so a neighbour's burst falls on each alike."""
    made, runs = [], [[] for _ in make_plans]
    plans = []
    for make in make_plans:
        start = time.perf_counter()
        plans.append(make())
        plans[-1].run(query, key, value, query.shape[-1] ** -0.5)
        made.append(time.perf_counter() - start)
    for _ in range(REPEATS):
        for plan, times in zip(plans, runs):
            start = time.perf_counter()
            plan.run(query, key, value, query.shape[-1] ** -0.5)
            times.append(time.perf_counter() - start)
    return [m + (layers - 1) * min(times) for m, times in zip(made, runs)]


@functools.cache
def measure(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, layers: int,
            threads: int) -> StepBackends:
    """`attn_backend="auto"` on the CPU for this attention geometry, from steps of DECODES decodes of which one is a
    run of r rows, r in ROWS. A decode step (r = 1): the C++ kernel attends decodes unless torch takes at most MARGIN
    of its time (then torch attends every step). Then for each longer r in turn, the C++ kernel attending the whole
    step against a split step (torch attending the run): the C++ kernel keeps the runs of every r until the split
    takes at most MARGIN of its time there; if it never does, it attends every step. So torch takes work from the
    kernel only where it is clearly faster: the kernel reads K/V in place where torch gathers it first, which is
    what a decode's cost is made of. Once per geometry and thread count in a process (~0.2-0.5 s); torch alone
    where the C++ kernel cannot serve or is not built."""
    if cpu_backend.supports(dtype, head_dim, block_size) is not None or not cpu_backend.available("cpu"):
        return StepBackends("torch")
    gen = torch.Generator().manual_seed(0)
    blocks = DECODES * blocks_for(CONTEXT + max(ROWS), block_size)
    key, value = (torch.randn(blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in "kv")
    measured = []
    for rows in (ROWS[0], *ROWS):            # the first shape twice: its first round warms both backends up
        batch = _batch(rows, block_size)
        query = torch.randn(batch.q_pos.numel(), num_heads, head_dim, generator=gen).to(dtype)
        other = functools.partial(TorchPlan, batch, block_size) if rows == 1 else \
            functools.partial(SplitPlan, batch, block_size, rows - 1)     # torch attends the run, C++ the decodes
        other_s, cpu_s = _step_seconds((other, functools.partial(cpu_backend.CpuPlan, batch, block_size)), query, key,
                                       value, layers)
        measured.append((rows, other_s, cpu_s))
    measured = measured[1:]
    if measured[0][1] <= MARGIN * measured[0][2]:
        rule = StepBackends("torch", measured=tuple(measured))
    else:
        split = next((i for i, (_, other_s, cpu_s) in enumerate(measured) if i and other_s <= MARGIN * cpu_s), None)
        rule = StepBackends("cpu", measured=tuple(measured)) if split is None else \
            StepBackends("torch", "cpu", ROWS[split - 1], tuple(measured))
    logger.info("attn_backend='auto' on the CPU (%d threads): %s; measured (rows of the long run, seconds with torch "
                "attending it, with the C++ kernel) a step: %s", threads, rule.describe(),
                [(r, round(t, 5), round(c, 5)) for r, t, c in measured])
    return rule
