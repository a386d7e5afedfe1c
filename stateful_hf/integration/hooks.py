"""How an unmodified transformers model becomes stateful: the hooks of the seam with transformers.

`enable(model)` registers the attention implementation (`attention.stateful_attention`), installs forward hooks
that plan one store step per forward and make it this thread's current step (`context.py`), and wraps `generate`
so that the full conversation ids are checked (`checks.py`) against the session's history before transformers
sees them. The decoder layers' pre-hooks that run a step's `before_layer` (`LayerHooks`) are there only while a
step with per-layer work runs (`StepBatch.has_layer_work`): any other forward calls its layers without a hook.
`run_step` runs an already planned step. docs/step.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch

from ..cache import StepBatch, TurnStats
from .adapter import ModelAdapter, adapter_for, decoder_layers
from .attention import register
from .checks import check_input_ids, check_pad_ids
from .compiled_step import base_forward
from .context import get_step, reset_step, set_step, stepping
from .stateful_cache import StatefulCache

_ENABLED = "_stateful_hf_adapter"
_LAYER_HOOKS = "_stateful_hf_layer_hooks"


def enable(model: torch.nn.Module) -> ModelAdapter:
    """Make `model` accept a StatefulCache in `generate` (also as `cache=`) and plain forward.
    Idempotent. Other calls of the model keep working: without a stateful step the attention is SDPA."""
    adapter = getattr(model, _ENABLED, None)
    if adapter is not None:
        return adapter
    adapter = adapter_for(model)
    model.set_attn_implementation(register())
    model.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    model.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    setattr(model, _LAYER_HOOKS, LayerHooks(decoder_layers(model)))
    model.generate = functools.partial(_generate, model, model.generate)
    setattr(model, _ENABLED, adapter)
    return adapter


def _pre_forward(module, args, kwargs):
    """Every forward of the model sets this thread's step: a planned one with a StatefulCache, else None."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, StatefulCache):
        set_step(None)
        return None
    if cache.pending is not None:           # a forward ended without its hook (KeyboardInterrupt): take it back
        _layer_hooks(module).release(cache.pending)
        cache.store.abort(cache.pending)
        cache.pending = None
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("a StatefulCache needs input_ids (inputs_embeds cannot be recorded for recomputation)")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"a StatefulCache serves one sequence; got input_ids of shape {tuple(input_ids.shape)} "
                         "(use stateful_hf.Engine for many sessions)")
    ids = input_ids[0].tolist()
    start = cache.get_seq_length()
    step = cache.store.plan_step([(cache.session_id, ids, range(start, start + len(ids)))])
    cache.pending = step
    _layer_hooks(module).hold(step)
    set_step(step)
    kwargs = {k: v for k, v in kwargs.items() if k != "attention_mask"}
    kwargs.update(input_ids=step.input_ids, position_ids=step.position_ids)
    return (), kwargs


def _post_forward(module, args, kwargs, output):
    """Registered with always_call: runs after the forward returned (commit) or raised (abort,
    `output` None); either way the thread's step ends here."""
    step = get_step()
    reset_step()
    cache = kwargs.get("past_key_values")
    if step is None or not isinstance(cache, StatefulCache) or cache.pending is not step:
        return None
    _layer_hooks(module).release(step)
    if output is None:                      # the forward raised: take the step back now
        cache.pending = None
        cache.store.abort(step)
        return None
    cache.store.commit(step)              # counts the step's rows in the session's last_turn
    cache.pending = None
    return None


class LayerHooks:
    """The decoder layers' pre-hooks of one model, registered (first of the layer's pre-hooks) while at least one
    step with per-layer work is held, on any thread, and removed when the last is released; a step without
    per-layer work holds nothing. The hooks read the thread's own step, so a thread whose step has no per-layer
    work (or none) passes through them untouched while another thread's step holds them."""

    def __init__(self, layers: Sequence[torch.nn.Module]):
        self.layers = list(layers)
        self.lock = threading.Lock()
        self.holders: set[int] = set()          # id() of the held steps
        self.handles: list = []

    def hold(self, step: StepBatch) -> None:
        """Before `step`'s forward: the hooks are there for it if it has per-layer work. Pair with `release`."""
        if not step.has_layer_work:
            return
        with self.lock:
            if not self.holders:
                self.handles = [layer.register_forward_pre_hook(_before_layer(idx), with_kwargs=True, prepend=True)
                                for idx, layer in enumerate(self.layers)]
            self.holders.add(id(step))

    def release(self, step: StepBatch) -> None:
        """After `step`'s forward (returned, raised or interrupted); a step not held is a no-op."""
        with self.lock:
            if id(step) not in self.holders:
                return
            self.holders.discard(id(step))
            if not self.holders:
                for handle in self.handles:
                    handle.remove()
                self.handles = []

    def installed(self) -> bool:
        """Whether the layers' pre-hooks are registered now."""
        return bool(self.handles)


def _layer_hooks(model: torch.nn.Module) -> LayerHooks:
    return getattr(model, _LAYER_HOOKS)


def _before_layer(idx: int):
    """Pre-hook of decoder layer `idx`: the current step's per-layer work, once, before the layer runs. Traced
    by `torch.compile` it is nothing: only a step without per-layer work runs compiled (`StepBatch.has_layer_work`)."""
    def hook(module, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        step = get_step()
        if step is not None:
            step.before_layer(idx, args[0] if args else kwargs["hidden_states"])
        return None
    return hook


def run_step(model: torch.nn.Module, step: StepBatch, logit_rows: torch.Tensor | None = None,
             forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One forward over a planned step, outside `generate`: the step is this thread's current step
    for the forward (`stepping`); the caller commits or aborts it. `forward`: the base forward to run
    ((input_ids, position_ids) -> hidden [T, D]: a `CompiledStep`, for a step without per-layer work);
    None: the eager one (`compiled_step.base_forward`).

    Returns the logits [len(logit_rows), vocab] of the given packed rows (with the model's final
    logit softcap, as its own forward applies it: Gemma 2), or, without `logit_rows`, the final
    hidden states [T, hidden] (no LM head: a pure restore pass).
    """
    forward = forward if forward is not None else base_forward(model)
    hooks = _layer_hooks(model)
    hooks.hold(step)
    try:
        with stepping(step):
            hidden = forward(step.input_ids, step.position_ids)
    finally:
        hooks.release(step)
    if logit_rows is None:
        return hidden
    logits = model.get_output_embeddings()(hidden[logit_rows])
    cap = getattr(model, _ENABLED).final_softcap
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def restore(model: torch.nn.Module, cache: StatefulCache) -> int:
    """Recompute the session's dropped history in one forward (its rows attend by absolute
    position, so any mix of dropped and present chunks is one sub-request). Returns tokens recomputed."""
    store, sid = cache.store, cache.session_id
    missing = store.missing_positions(sid)
    if not missing:
        return 0
    history = store.token_ids(sid)
    step = store.plan_step([(sid, [history[p] for p in missing], missing)])
    try:
        with torch.inference_mode():
            run_step(model, step)
    except BaseException:
        store.abort(step)
        raise
    store.commit(step)
    return len(missing)


def prepare_turn(model: torch.nn.Module, cache: StatefulCache, ids: Sequence[int]) -> TurnStats:
    """Cut what diverges from `ids`, restore what is missing; the session then holds a prefix of `ids`
    (at least one token short of it, so the turn computes logits). Returns the session's last_turn,
    which the store fills (`KVStore.begin_turn`; recomputed rows are counted as their step commits)."""
    turn = cache.store.begin_turn(cache.session_id, ids)
    restore(model, cache)
    return turn


def _generate(model, original_generate, *args, cache=None, past_key_values=None, **kwargs):
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache once: as cache= or as past_key_values=")
    cache = cache if cache is not None else past_key_values
    if not isinstance(cache, StatefulCache):
        return original_generate(*args, past_key_values=cache, **kwargs)
    if getattr(cache.store, "model", None) is not model:
        raise ValueError("this StatefulCache belongs to a store of another model")
    input_ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("generate with a StatefulCache needs input_ids")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError("padding is not supported with a StatefulCache: pass one unpadded sequence")
    ids = check_input_ids(input_ids, getattr(model, _ENABLED))
    if mask is None:
        check_pad_ids(model, input_ids, ids, kwargs)
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)
    kwargs.pop("attention_mask", None)
    store = cache.store
    with store.lease(cache.session_id), invariant(store):
        try:
            prepare_turn(model, cache, ids)
            out = original_generate(input_ids, past_key_values=cache, **kwargs)
        finally:
            if cache.pending is not None:     # a forward left without its hook (KeyboardInterrupt)
                reset_step()
                _layer_hooks(model).release(cache.pending)
                store.abort(cache.pending)
                cache.pending = None
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        store.add_generated(cache.session_id, seqs.shape[1] - len(ids))
        return out


def invariant(store):
    """The context a store's forwards run under: `batch_invariant(chunk_size)` for a store made with
    batch_invariant=True (`SessionStore.invariant_split`), else nothing."""
    split = getattr(store, "invariant_split", None)
    if split is None:
        return nullcontext()
    from ..kernels.invariance import batch_invariant
    return batch_invariant(split)
