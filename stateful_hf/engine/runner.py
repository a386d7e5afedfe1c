"""The model runner: one step = one store plan + one forward of the unmodified model + sampling.

The store builds the packed step (ids, positions, per-entry query ranges, block tables) once on
the CPU; `run_step` makes it the engine thread's current step for one forward (the step context
read by the registered attention and the decoder-layer hooks: docs/step.md) and applies the LM head
only at the rows that need a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import StepBatch
from ..integration import run_step
from .sampling import sample, token_logprobs
from .work_item import WorkItem


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step ran (for metrics and tests). Per entry, in row order:
    (session_id, recomputed rows, new rows, sampled a token)."""

    index: int
    entries: tuple[tuple[str, int, int, bool], ...]
    num_tokens: int
    seconds: float
    used_blocks: int                   # device blocks in use after the step
    total_blocks: int

    @property
    def num_decode(self) -> int:
        """Entries that fed exactly one new token and sampled (decode rows)."""
        return sum(1 for _, rec, new, s in self.entries if rec == 0 and new == 1 and s)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, store):
        self.model, self.store = model, store

    def execute(self, items: Sequence[WorkItem]) -> tuple[StepBatch, list[int]]:
        """Plan, run and commit one step; returns the step and one sampled token per item that needs
        logits (in item order). On any error the step is aborted (the store is as before) and the
        error raised: CapacityError from planning, or whatever the forward raised."""
        factors = [it.factor for it in items] if any(it.factor != 1 for it in items) else None
        step = self.store.plan_step([it.entry() for it in items], factors=factors)
        try:
            last = step.last_rows()                            # [S] last packed row of each entry
            want = [i for i, it in enumerate(items) if it.needs_logits]
            tokens: list[int] = []
            with torch.inference_mode():
                if want:
                    logits = run_step(self.model, step, last[want])          # [len(want), V]
                    tokens = sample(logits, [items[i].request.sampling for i in want],
                                    [items[i].request.generator for i in want])
                    _keep_logprobs([items[i].request for i in want], logits, tokens)
                else:                                                  # prefill/recompute chunks only
                    run_step(self.model, step)
        except BaseException:
            self.store.abort(step)
            raise
        self.store.commit(step)
        return step, tokens

    def record(self, index: int, items: Sequence[WorkItem], seconds: float) -> StepRecord:
        pool = self.store.device_pool
        return StepRecord(
            index=index,
            entries=tuple((it.request.session_id, len(it.recompute), len(it.new_ids), it.needs_logits)
                          for it in items),
            num_tokens=sum(it.num_tokens for it in items), seconds=seconds,
            used_blocks=pool.num_blocks - pool.num_free, total_blocks=pool.num_blocks,
        )


def _keep_logprobs(requests, logits: torch.Tensor, tokens: list[int]) -> None:
    """Append each asking request's chosen-token log-probability, from the logits `sample` used.
    `complete` appends every sampled token to output_ids, so the two lists stay aligned."""
    rows = [j for j, r in enumerate(requests) if r.sampling.logprobs is not None]
    if not rows:
        return
    got = token_logprobs(logits[rows], [tokens[j] for j in rows], [requests[j].sampling.logprobs for j in rows])
    for j, entry in zip(rows, got, strict=True):
        requests[j].logprobs.append(entry)
