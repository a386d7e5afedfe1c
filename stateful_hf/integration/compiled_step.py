"""The compiled step: the model's base forward over a step's packed rows through `torch.compile`, for steps
without per-layer work. docs/step.md ("The compiled step").

    compiled = CompiledStep(model)            # inductor, one graph for every token count, no row padding
    compiled.warm_up()                        # trace and compile before any request (`step_ops.warming`)
    hidden = run_step(model, step, rows, forward=compiled)    # a step with has_layer_work runs eager instead

`decide_compile(option, ...)` is the engine's choice from its `compile` option: compile or not, and why.
A token count whose compiled forward raises runs eager from then on (`failed`), logged once, the step
itself rerun eager (its K/V rewritten at the same slots): a compile failure never fails a request.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters
from tqdm.auto import tqdm

from . import step_ops

logger = logging.getLogger(__name__)

# A prepared 4-D mask makes transformers skip building its own (the kernel masks by position).
MASK_UNUSED = torch.ones(1, 1, 1, 1, dtype=torch.bool)
_IDS = itertools.count()
WARM_UP_TOKENS = (1, 2)        # token counts run at start: the first compiles the one graph, the second checks it


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


class GraphMode(enum.Enum):
    """How the compiled step's graphs cover the token counts T of the steps."""

    ONE = "one graph for every token count, no guards"      # T unbacked; the default
    GUARDED = "a graph for 1 token and one for more, guards checked"   # T backed; for a model ONE does not trace


class CompiledStep:
    """`torch.compile` of the model's base forward. By default **one graph for every token count** T of a step
    (`GraphMode.ONE`): T is an unbacked symbol (`mark_unbacked`), so the compiler assumes nothing of it (not even
    T != 1, which would make T = 1 a graph of its own), and the graph keeps **no guards**
    (`skip_all_guards_unsafe`, as vLLM's compiled models): with a single graph there is nothing to choose between,
    and evaluating them (every parameter of every layer) cost ~1 ms a step of a 30-layer model. What that asks of
    the caller: the model's parameters keep their shapes, dtypes and device for the life of the engine (an engine
    owns its model), and every call passes int64 ids and positions [1, T] on the model's device (`_own`).
    ONE is compiled with `fullgraph=True` (a break would hand the layers' own frames to Dynamo, unguarded). A model
    that does not compile that way (its forward branches on T, as torchao's int8 dynamic activations ask
    `T != 1`, or breaks the graph) fails before any ONE call succeeded: that failure (the step rerun eager, or a
    warm-up count) switches it to `GraphMode.GUARDED` (T backed and dynamic, guards kept, the engine's
    `fullgraph`), logged once. Calls as the eager forward does; `failed` holds the token counts that run
    eager (their error), `steps` counts compiled forwards."""

    def __init__(self, model: torch.nn.Module, backend: str = "inductor", fullgraph: bool = False):
        self.eager = base_forward(model)
        self.device = next(model.parameters()).device
        self.backend, self.fullgraph = backend, fullgraph
        self.mode = GraphMode.ONE
        self.compiled = self._compile()
        self.failed: dict[int, str] = {}
        self.steps = 0
        self.start_seconds: float | None = None       # the warm-up's seconds
        self.start_cache = ""                          # where the warm-up's graph came from
        self.guarded_because = ""                      # why ONE did not compile (GUARDED mode)
        self._traced = False                           # a compiled call of the current mode has succeeded
        self._logged = False

    def _compile(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        options: dict = {}
        if self.backend == "inductor" and self.device.type == "cpu":
            options["cpp.dynamic_threads"] = True     # one compile serves every OpenMP team size the engine uses
        if self.mode is GraphMode.ONE:
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        # ONE is always fullgraph: after a graph break Dynamo compiles the called frames (every decoder layer shares
        # one `forward`) keyed by their code, and without guards one layer's entry would serve them all
        one = self.mode is GraphMode.ONE
        return torch.compile(_own_code(self.eager), backend=self.backend, fullgraph=one or self.fullgraph,
                             dynamic=None if one else True, options=options)

    def warm_up(self, tokens: tuple[int, ...] = WARM_UP_TOKENS) -> float:
        """Trace and compile the one graph (the first count), then run it at the others (inert ops: no store
        step), with a tqdm bar on a terminal; returns the seconds it took (`start_seconds`; `start_cache` says
        whether inductor's on-disk caches served it). A count that does not compile raises ValueError with the
        compiler's error (the model cannot compile)."""
        start, steps = time.perf_counter(), self.steps
        before = dict(counters["inductor"])
        with tqdm(total=len(tokens), desc="stateful-hf: compiling the step (once per model and process)",
                  unit="shape", leave=False, disable=None) as bar:
            i = 0
            while i < len(tokens):
                t, mode = tokens[i], self.mode
                ids = torch.zeros(1, t, dtype=torch.long, device=self.device)
                pos = torch.arange(t, device=self.device)[None]
                with torch.inference_mode(), step_ops.warming():
                    self._call(ids, pos)
                if self.mode is not mode:                  # ONE's first call failed: GUARDED, the same count again
                    continue
                if t in self.failed:
                    if self.mode is GraphMode.ONE:         # ONE ran at an earlier count, not at this one
                        self._guard(t, self.failed.pop(t))
                        self.failed.clear()
                        i = 0
                        bar.reset()
                        continue
                    raise ValueError(f"compile=True: the step of this model does not compile ({t} tokens): "
                                     f"{self.failed[t]}")
                i += 1
                bar.update(1)
        self.steps = steps
        self.start_seconds = time.perf_counter() - start
        hits, misses = (counters["inductor"][k] - before.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
        self.start_cache = ("inductor's disk cache" if hits and not misses else "a cold compile" if misses
                            else f"the {self.backend} backend (no inductor graph)")
        logger.info("compiled the step (%s) in %.1f s, from %s", self.backend, self.start_seconds, self.start_cache)
        return self.start_seconds

    def _guard(self, t: int, why: str) -> None:
        """ONE did not compile (at `t` tokens, for `why`): from now on GUARDED, compiled afresh on the next call."""
        self.mode, self.guarded_because, self._traced = GraphMode.GUARDED, why.splitlines()[0][:200], False
        self.compiled = self._compile()
        logger.warning("the compiled step does not compile as one graph with its token count unbacked (%d tokens: "
                       "%s); it compiles with guards, one graph for 1 token and one for more", t, self.guarded_because)

    def describe(self) -> str:
        """How the engine's compile started, for `EngineStats.compile`."""
        how = self.mode.value + (f" ({self.guarded_because})" if self.guarded_because else "")
        if self.start_seconds is None:
            return f"{how}; not compiled yet"
        return f"{how}; compiled at engine start in {self.start_seconds:.1f} s, from {self.start_cache}"

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:   # [T, D]
        return self._call(input_ids, position_ids)

    def _own(self, t: torch.Tensor) -> torch.Tensor:     # [1, T] -> [1, T]
        """A copy of `t` of its own (microseconds for [1, T] ids), so every call hands the graph the same kind of
        tensor (contiguous, no view's base, the step's dispatch keys); in `GraphMode.ONE` with its token dimension
        unbacked, so the one graph compiled for it makes no assumption on T."""
        own = t.clone()
        if self.mode is GraphMode.ONE:
            torch._dynamo.decorators.mark_unbacked(own, 1)
        return own

    def _call(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        if t in self.failed:
            return self.eager(input_ids, position_ids)
        own_ids, own_pos = self._own(input_ids), self._own(position_ids)
        try:
            out = self.compiled(own_ids, own_pos)
        except Exception as error:
            out = self.eager(input_ids, position_ids)        # a real error of the step raises here
            why = f"{type(error).__name__}: {error}"
            if self.mode is GraphMode.ONE and not self._traced:     # no graph of this mode ran yet
                self._guard(t, why)
                return out
            self.failed[t] = why
            if not self._logged:
                self._logged = True
                logger.warning("the compiled step failed for %d tokens; that shape (and any later failing one) "
                               "runs eager: %s", t, why.splitlines()[0])
            return out
        self._traced = True
        self.steps += 1
        return out


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` with a code object of its own: Dynamo keeps its graphs (and counts recompiles against its limit of 8,
    past which it would run eager unannounced) per code object, so each CompiledStep (one per engine, of any
    model) has its own cache of graphs rather than sharing one limit with every other engine."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_IDS)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
