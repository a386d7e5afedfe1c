"""The compiled step: the model's base forward over a step's packed rows through `torch.compile`, for steps
without per-layer work. docs/step.md ("The compiled step").

    compiled = CompiledStep(model)            # inductor, dynamic token dimension, no row padding
    compiled.warm_up()                        # trace and compile before any request (`step_ops.warming`)
    hidden = run_step(model, step, rows, forward=compiled)    # a step with has_layer_work runs eager instead

`decide_compile(option, ...)` is the engine's choice from its `compile` option: compile or not, and why.
A token count whose compiled forward raises runs eager from then on (`failed`), logged once, the step
itself rerun eager (its K/V rewritten at the same slots): a compile failure never fails a request.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import step_ops

logger = logging.getLogger(__name__)

# A prepared 4-D mask makes transformers skip building its own (the kernel masks by position).
MASK_UNUSED = torch.ones(1, 1, 1, 1, dtype=torch.bool)
_IDS = itertools.count()
WARM_UP_TOKENS = (1, 2)        # token counts traced at start: 1 (a size-1 dim is its own graph) and dynamic T


def base_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The eager step forward of `model`: (input_ids [1, T], position_ids [1, T]) -> final hidden states [T, D]."""
    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model.base_model(input_ids=input_ids, position_ids=position_ids, attention_mask=MASK_UNUSED,
                                use_cache=False).last_hidden_state[0]
    return forward


@dataclass(frozen=True, slots=True)
class CompileDecision:
    """Whether the engine's steps run compiled, and the reason (shown in `EngineStats.compile`)."""

    enabled: bool
    reason: str

    def describe(self) -> str:
        return f"inductor ({self.reason})" if self.enabled else f"eager ({self.reason})"


def decide_compile(option: bool | str, device: torch.device, *, invariant: bool,
                   hidden_states: bool) -> CompileDecision:
    """The engine's `compile` option ("auto", True, False) for a store on `device`. `compile=True` where the
    steps cannot compile raises ValueError naming what is unsupported; "auto" stays eager with the reason."""
    if option is False:
        return CompileDecision(False, "compile=False")
    refusal = None
    if invariant:
        refusal = ("a batch-invariant store (the bf16 default on the CPU): inductor's reductions sum in another "
                   "order and would bypass the invariant kernels")
    elif hidden_states:
        refusal = ("a store that keeps hidden states captures them in every layer of every step (per-layer work, "
                   "which runs eager)")
    if refusal is not None:
        if option is True:
            raise ValueError(f"compile=True is unsupported with {refusal}; use compile='auto' or False")
        return CompileDecision(False, f"auto: {refusal}")
    if option is True:
        return CompileDecision(True, "compile=True")
    return CompileDecision(False, f"auto: eager on {device.type} for now (an inductor compile of the step takes "
                                  "minutes on a small CPU; compile=True turns it on)")


class CompiledStep:
    """`torch.compile` of the model's base forward with a dynamic token dimension. Calls as the eager forward
    does; `failed` holds the token counts that run eager (their error), `steps` counts compiled forwards."""

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", fullgraph: bool = False):
        self.eager = base_forward(model)
        self.device = next(model.parameters()).device
        options = {"cpp.dynamic_threads": True} if backend == "inductor" and self.device.type == "cpu" else None
        self.compiled = torch.compile(_own_code(self.eager), backend=backend, fullgraph=fullgraph, dynamic=True,
                                      options=options)
        self.backend = backend
        self.failed: dict[int, str] = {}
        self.steps = 0
        self.start_seconds: float | None = None
        self._logged = False

    def warm_up(self, tokens: tuple[int, ...] = WARM_UP_TOKENS) -> float:
        """Trace and compile for these token counts (inert ops: no store step); returns the seconds it took.
        A count that does not compile raises ValueError with the compiler's error (the model cannot compile)."""
        start, steps = time.perf_counter(), self.steps
        for t in tokens:
            ids = torch.zeros(1, t, dtype=torch.long, device=self.device)
            pos = torch.arange(t, device=self.device)[None]
            with torch.inference_mode(), step_ops.warming():
                self._call(ids, pos)
            if t in self.failed:
                raise ValueError(f"compile=True: the step of this model does not compile ({t} tokens): "
                                 f"{self.failed[t]}")
        self.steps = steps
        self.start_seconds = time.perf_counter() - start
        logger.info("compiled the step (%s) in %.1f s", self.backend, self.start_seconds)
        return self.start_seconds

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:   # [T, D]
        return self._call(input_ids, position_ids)

    @staticmethod
    def _own(t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` of its own (microseconds for [1, T] ids): the compiler guards a view's base and an
        input's dispatch keys (an inference tensor or not), so every call hands it the same kind of tensor."""
        return t.clone()

    def _call(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t in self.failed:
            return self.eager(input_ids, position_ids)
        input_ids, position_ids = self._own(input_ids), self._own(position_ids)
        try:
            out = self.compiled(input_ids, position_ids)
        except Exception as error:
            out = self.eager(input_ids, position_ids)        # a real error of the step raises here
            self.failed[t] = f"{type(error).__name__}: {error}"
            if not self._logged:
                self._logged = True
                logger.warning("the compiled step failed for %d tokens; that shape (and any later failing one) "
                               "runs eager: %s", t, self.failed[t].splitlines()[0])
            return out
        self.steps += 1
        return out


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own: Dynamo keeps its graphs (and counts recompiles against its limit of 8,
    past which it would run eager unannounced) per code object, so each CompiledStep (one per engine, of any
    model) has its own cache of two graphs rather than sharing one limit with every other engine."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
