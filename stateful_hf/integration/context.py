"""The step context, nano-vllm's forward `Context`: the step of the forward running on this thread, set once
per forward. Who sets it: the model's forward pre-hook (`hooks._pre_forward`: a forward with a StatefulCache,
including each forward of `generate`) and `run_step` (the engine, a restore, the profiles). Who resets it: the
forward hook (`hooks._post_forward`, registered with `always_call`, so it also runs when the forward raises) and
`run_step`'s `finally`. Who reads it: `stateful_attention` and the decoder-layer pre-hooks. No keyword argument
carries the step.

Thread rule: the value is a `ContextVar`, so each thread (and each asyncio task) sees its own. The engine steps on
its own thread while other threads may call a plain or a stateful `generate` of the same model: none of them sees
another's step. A forward of an enabled model sets the context to its step or to None before anything reads it,
so only `model.base_model(...)` called directly, after a KeyboardInterrupt escaped a stateful forward on the same
thread, could see a stale step.

What the context holds is a `CurrentStep`: the step and what its attention derives from it once per step (the
kernel plan, made by the first layer and run directly by the others: `attention.stateful_attention`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..cache import StepBatch
from ..kernels import paged_attention
from ..kernels.dense import dense_attention
from ..kernels.kernel_plan import KernelPlan, plan_for


class CurrentStep:
    """This thread's step and its per-step attention state: `plan` and `shapes` (query, key cache) are set by the
    first layer that attends (None before), and read by the later ones. One per forward, never shared."""

    __slots__ = ("step", "plan", "shapes")

    def __init__(self, step: StepBatch):
        self.step = step
        self.plan: KernelPlan | None = None
        self.shapes: tuple | None = None

    def attend(self, layer: int, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               scale: float | None, window: int | None, softcap: float | None, overlay=None) -> torch.Tensor:
        """Attention of the step's rows of `layer` (query [T, Hq, D], the layer's pool views
        [blocks, block_size, Hkv, D]) -> [T, Hq, D], the eager path's and the compiled step's op's. The virtual
        layout attends its contiguous slots (`dense_attention`); the paged one goes, at the first layer, through
        `paged_attention`'s checks with the step's plan, and a later layer with the same shapes and no overlay runs
        the plan directly."""
        step = self.step
        if step.dense_slots is not None:   # vAttention layout: contiguous per session, no block table
            key_slots, value_slots = step.pool.dense(layer)
            return dense_attention(query, key_slots, value_slots, step.paged, list(step.dense_slots),
                                   scale=scale if scale is not None else query.shape[-1] ** -0.5,
                                   window=window, softcap=softcap)
        shapes = (query.shape, key_cache.shape, key_cache.stride(), query.dtype)
        if self.plan is not None and overlay is None and shapes == self.shapes:     # checked by an earlier layer
            return self.plan.run(query, key_cache, value_cache, scale if scale is not None else query.shape[-1] ** -0.5,
                                 window, None, softcap)
        plan = plan_for(step.paged, key_cache.shape[1], step.backend, query.dtype, step.kernels,
                        head_dim=query.shape[-1])
        out = paged_attention(query, key_cache, value_cache, step.paged, scale=scale, backend=step.backend,
                              window=window, validate=False, plan=plan, overlay=overlay, softcap=softcap,
                              state=step.kernels)
        self.plan, self.shapes = plan, shapes
        return out


_STEP: ContextVar[CurrentStep | None] = ContextVar("stateful_hf_step", default=None)


def get_step() -> StepBatch | None:
    """The step of the forward running on this thread; None outside one (an ordinary call)."""
    current = _STEP.get()
    return None if current is None else current.step


def current_step() -> CurrentStep | None:
    """This thread's `CurrentStep`; None outside a step."""
    return _STEP.get()


def set_step(step: StepBatch | None) -> None:
    """Make `step` this thread's current step (None: an ordinary forward). Pair with `reset_step`."""
    _STEP.set(None if step is None else CurrentStep(step))


def reset_step() -> None:
    """End this thread's current step (the forward returned or raised)."""
    _STEP.set(None)


@contextmanager
def stepping(step: StepBatch) -> Iterator[StepBatch]:
    """`step` is this thread's current step inside the block, and no longer after it, however it exits."""
    _STEP.set(CurrentStep(step))
    try:
        yield step
    finally:
        _STEP.set(None)
