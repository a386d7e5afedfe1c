"""The step's two graph nodes: `torch.ops.stateful_hf.write_kv` and `torch.ops.stateful_hf.attention`, each defined
on a `torch.library.Library` with its CPU and CUDA kernel and a fake implementation, so a compiled step sees the
K/V write and the paged attention as two opaque calls. docs/step.md ("The compiled step"). Registered directly, as
vLLM's `direct_register_custom_op`, not with `torch.library.custom_op`: its Python dispatch layers cost ~2 us a
call (3.8 against 1.9 here), 60 calls a step on a 30-layer model.

As vLLM's `unified_kv_cache_update` / `unified_attention`: the graph passes the layer's tensors and constants
(layer index, scale, window, softcap); the op's body, which runs eagerly outside the graph, reads the step's
metadata (slots, block tables, the kernel plan, the pool) from this thread's step context (`context.py`). So no
`ContextVar` read, no host synchronisation and no branch on step data is traced: the graph is the same for every
step of its token count. `write_kv` returns an empty tensor that `attention` takes (`dep`): the data dependency
that keeps each layer's write before its attention whatever order the compiler chooses.

A step with per-layer work (`StepBatch.has_layer_work`: swap-in events, hidden-state capture or restore, LayerKV
placement) never reaches these ops: it runs eager (`stateful_attention`'s own path). `warming()` lets the
engine trace and compile its step before any request: inside it the ops write nothing and attend to nothing
(zeros), so a warm-up forward needs no store step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .context import CurrentStep, current_step

_WARMING: ContextVar[bool] = ContextVar("stateful_hf_warming", default=False)
NO_WINDOW_ARG = -1          # `sliding_window` of `attention`: the model passed none (nothing to check)


@contextmanager
def warming() -> Iterator[None]:
    """Inside the block (this thread), the ops are inert: a forward traced and compiled ahead of any step."""
    token = _WARMING.set(True)
    try:
        yield
    finally:
        _WARMING.reset(token)


def _current(layer: int) -> CurrentStep:
    current = current_step()
    if current is None:
        raise RuntimeError(f"stateful_hf::attention of layer {layer} ran outside a stateful step: a compiled forward "
                           "of an enabled model runs only as an engine step (Engine(compile=...))")
    if current.step.has_layer_work:
        raise RuntimeError(f"layer {layer}: a step with per-layer work (swap-in, hidden states, LayerKV) reached the "
                           "compiled path; it must run eager")
    return current


_LIB = torch.library.Library("stateful_hf", "FRAGMENT")


def _register(fn, fake):
    """`fn` as `torch.ops.stateful_hf.<its name>` (schema from its annotations; mutates nothing), its kernel for
    the CPU and CUDA, `fake` for tracing; returns the op."""
    name = fn.__name__.lstrip("_")
    _LIB.define(name + torch.library.infer_schema(fn, mutates_args=()))
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, fn, key)
    torch.library.register_fake(f"stateful_hf::{name}", fake, lib=_LIB)
    return getattr(torch.ops.stateful_hf, name)


def _write_kv(key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
    """Write the step's rows' K/V of `layer` ([T, Hkv, D]) at the step's slots (`StepBatch.write_rows`, the one
    K/V writer). Returns an empty tensor: `attention`'s `dep`, ordering the write before the read."""
    if not _WARMING.get():
        step = _current(layer).step
        key_cache, value_cache = step.pool.layer(layer)
        step.write_rows(layer, key_cache, value_cache, key, value)
    return key.new_empty(0)


def _write_kv_fake(key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
    return key.new_empty(0)


write_kv = _register(_write_kv, _write_kv_fake)


def _attention(query: torch.Tensor, dep: torch.Tensor, layer: int, scale: float | None, softcap: float | None,
              sliding_window: int | None) -> torch.Tensor:
    """Causal attention of the step's rows of `layer` (query [T, Hq, D]) over the pool layer `write_kv` wrote
    (`dep`: its result): [T, Hq, D], contiguous (the fake's layout). `sliding_window`: what the model's attention
    passed (NO_WINDOW_ARG: none), checked against the window the store was made with."""
    if _WARMING.get():
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    current = _current(layer)
    step = current.step
    window = step.window(layer)
    if sliding_window != NO_WINDOW_ARG and sliding_window != window:
        raise RuntimeError(f"layer {layer} attends with sliding_window={sliding_window} but the store was made for "
                           f"window {window}: the model's adapter is out of date")
    key_cache, value_cache = step.pool.layer(layer)
    return current.attend(layer, query, key_cache, value_cache, scale, window, softcap).contiguous()


def _attention_fake(query: torch.Tensor, dep: torch.Tensor, layer: int, scale: float | None, softcap: float | None,
                    sliding_window: int | None) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)


attention = _register(_attention, _attention_fake)
