"""The model runner: one step = one store plan + one forward of the unmodified model + sampling.

The store builds the packed step (ids, positions, per-entry query ranges, block tables) once on
the CPU; `run_step` makes it the engine thread's current step for one forward (the step context
read by the registered attention and the decoder-layer hooks: docs/step.md) and applies the LM head
only at the rows that need a token. With the engine's `compile` on, a step without per-layer work
runs its forward through the `CompiledStep` made (and compiled) here; sampling runs beside it, eager.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..cache.doors.engine import Committed, EngineStore, StepBatch
from ..integration.compiled_step import CompileDecision, CompiledStep, decide_compile
from ..integration.hooks import invariant, run_step
from ..kernels.cpu_features import CpuFeatures
from ..kernels.linear import LinearKernel, PackedWeights, choose, measure
from ..options import PrepackWeights
from .request import WorkItem
from .sampling import eos_ids, sample, token_logprobs

logger = logging.getLogger(__name__)


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


def packed_weights(model: torch.nn.Module, mode: PrepackWeights, rows: int,
                   invariant: bool = False) -> tuple[PackedWeights | None, str]:
    """The model's packed linear weights for the engine's steps (option prepack_weights), or None, and what was
    decided and why (`EngineStats.linear`). A batch-invariant store's steps multiply by the model's own weights
    (the invariant GEMM). "auto" packs where this CPU has a packed kernel for the model's dtype (capability) and
    that kernel measured faster than F.linear on the model's own weights here (`measure`; never by vendor); "on"
    packs wherever a kernel exists."""
    if invariant and mode is PrepackWeights.ON:
        raise ValueError("prepack_weights='on' with a batch_invariant store: its steps run the invariant GEMM on "
                         "the model's own weights; use prepack_weights='auto' or 'off'")
    if mode is PrepackWeights.OFF:
        return None, "F.linear (prepack_weights='off')"
    if invariant:
        return None, "the batch-invariant GEMM (a batch-invariant store)"
    p = next(model.parameters())
    kernel = choose(p.dtype, p.device, CpuFeatures.detect(), required=mode is PrepackWeights.ON)
    if kernel is LinearKernel.STOCK:
        return None, f"F.linear (no packed kernel for {str(p.dtype).removeprefix('torch.')} on {p.device.type})"
    why = f"{kernel} (prepack_weights='on')"
    if mode is PrepackWeights.AUTO:
        trial = measure(model, kernel, rows)
        logger.info("prepack_weights='auto': %s", trial.describe())
        if not trial.pays:
            return None, f"F.linear (auto: {trial.describe()})"
        why = f"{kernel} (auto: {trial.describe()})"
    return PackedWeights.install(model, kernel, rows), why


class ModelRunner:
    def __init__(self, model: torch.nn.Module, store: EngineStore, packed: PackedWeights | None = None,
                 compile: bool | str = False):
        """`compile`: the engine's option; when on, the step is compiled here (`CompiledStep.warm_up`), before
        any request; a model or store that cannot compile with compile=True raises ValueError here."""
        self.model, self.store = model, store
        self.packed = packed          # None: F.linear on the model's weights
        self.compile: CompileDecision = decide_compile(
            compile, next(model.parameters()).device, invariant=store.invariant_split is not None,
            hidden_states=store.keeps_hidden)
        self.compiled: CompiledStep | None = None
        self._packed_in_graph = False   # the compiled graph's linear layers on MKL's packed copies
        if self.compile.enabled:
            compiled = CompiledStep(model)
            self.compile_with(compiled, self.compile)
            compiled.warm_up()

    def compile_with(self, compiled: CompiledStep, decision: CompileDecision) -> None:
        """Run the steps without per-layer work through `compiled` (traced at its warm-up or first call), its
        graph's linear layers on the packed copies where MKL packed them (`PackedWeights.in_graph`)."""
        self._packed_in_graph = self.packed is not None and self.packed.in_graph()
        self.compile, self.compiled = decision, compiled

    def execute(self, items: Sequence[WorkItem]) -> tuple[StepBatch, list[int], Committed]:
        """Plan, run and commit one step; returns the step, one sampled token per item that needs
        logits (in item order) and what the commit answered. On any error the step is aborted (the
        store is as before) and the error raised: CapacityError from planning, or whatever the forward
        raised."""
        factors = [it.factor for it in items] if any(it.factor != 1 for it in items) else None
        step = self.store.plan_step([it.entry() for it in items], factors=factors)
        try:
            last = step.last_rows()                            # [S] last packed row of each entry
            want = [i for i, it in enumerate(items) if it.needs_logits]
            requests = [items[i].request for i in want]
            constrained = any(r.grammar is not None for r in requests)
            tokens: list[int] = []
            with torch.inference_mode(), (self.packed.active() if self.packed is not None else nullcontext()), \
                    invariant(self.store):
                forward = self.compiled if self.compiled is not None and not step.has_layer_work else None
                if want:
                    logits = run_step(self.model, step, last[want], forward)          # [len(want), V]
                    if constrained:      # structured output: only a step with a constrained request imports it
                        from .grammar import mask_logits
                        mask_logits(logits, requests)
                    tokens = sample(logits, [r.sampling for r in requests], [r.generator for r in requests],
                                    [r.prompt for r in requests], [r.output_ids for r in requests], eos_ids(self.model))
                    _keep_logprobs(requests, logits, tokens)
                else:                                                  # prefill/recompute chunks only
                    run_step(self.model, step, forward=forward)
        except BaseException:
            self.store.abort(step)
            raise
        committed = self.store.commit(step)
        if constrained:                  # the tokens are the sessions' now: advance the grammars
            from .grammar import accept_tokens
            accept_tokens(requests, tokens)
        return step, tokens, committed

    def compile_stats(self) -> tuple[str, int]:
        """`EngineStats`' compile fields: how the steps run (and why), and how many forwards ran compiled."""
        if self.compiled is None:
            return self.compile.describe(), 0
        packed = "; linear layers on MKL's packed weights" if self._packed_in_graph else ""
        return f"{self.compile.describe()}; {self.compiled.describe()}{packed}", self.compiled.steps

    def record(self, index: int, entries: Sequence[tuple[str, int, int, bool]], seconds: float,
               committed: Committed | None) -> StepRecord:
        """The step's record from its `entries` (per item, in row order: session id, recomputed rows, new rows,
        sampled a token); `committed`: what its commit answered (None: ask the store for the free blocks)."""
        total = self.store.pool_sizes.device_blocks
        free = committed.device_free if committed is not None else self.store.free_blocks()
        return StepRecord(index=index, entries=tuple(entries), num_tokens=sum(e[1] + e[2] for e in entries),
                          seconds=seconds, used_blocks=total - free, total_blocks=total)


def _keep_logprobs(requests, logits: torch.Tensor, tokens: list[int]) -> None:
    """Append each asking request's chosen-token log-probability, from the logits `sample` used.
    `complete` appends every sampled token to output_ids, so the two lists stay aligned."""
    rows = [j for j, r in enumerate(requests) if r.sampling.logprobs is not None]
    if not rows:
        return
    got = token_logprobs(logits[rows], [tokens[j] for j in rows], [requests[j].sampling.logprobs for j in rows])
    for j, entry in zip(rows, got, strict=True):
        requests[j].add_logprob(entry)
