"""How an unmodified transformers model becomes stateful, the project's one seam with transformers.

`enable(model)` registers the attention implementation (`stateful_attention`), installs forward hooks
that plan one store step per forward and make it this thread's current step, one pre-hook per
decoder layer that runs the step's `before_layer`, and wraps `generate` so that the full conversation
ids are checked against the session's history before transformers sees them. `run_step` runs an
already planned step. docs/step.md.

The attention reads this thread's step, has the step write each row's K/V (`StepBatch.write_rows`,
the one K/V writer) and attends through the paged kernel. Without a step (any ordinary call of the
same model) it is plain SDPA, or the model's eager attention when it softcaps logits.

The step context, nano-vllm's forward `Context`, set once per forward. Who sets it: the model's
forward pre-hook (`_pre_forward`: a forward with a StatefulCache, including each forward of
`generate`) and `run_step` (the engine, a restore, the profiles). Who resets it: the forward hook
(`_post_forward`, registered with `always_call`, so it also runs when the forward raises) and
`run_step`'s `finally`. Who reads it: `stateful_attention` and the decoder-layer pre-hooks
(`_before_layer`). No keyword argument carries the step.

Thread rule: the value is a `ContextVar`, so each thread (and each asyncio task) sees its own. The
engine steps on its own thread while other threads may call a plain or a stateful `generate` of the
same model: none of them sees another's step. A forward of an enabled model sets the context to its
step or to None before anything reads it, so only `model.base_model(...)` called directly, after a
KeyboardInterrupt escaped a stateful forward on the same thread, could see a stale step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .adapter import ModelAdapter, adapter_for, decoder_layers
from .cache import StepBatch, TurnStats
from .kernels import paged_attention
from .kernels.dense import dense_attention
from .kernels.torch_batched import softcapped_attention
from .stateful_cache import StatefulCache

_ENABLED = "_stateful_hf_adapter"


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
    for idx, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(_before_layer(idx), with_kwargs=True)
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
    if output is None:                      # the forward raised: take the step back now
        cache.pending = None
        cache.store.abort(step)
        return None
    cache.store.commit(step)              # counts the step's rows in the session's last_turn
    cache.pending = None
    return None


def _before_layer(idx: int):
    """Pre-hook of decoder layer `idx`: the current step's per-layer work, once, before the layer runs."""
    def hook(module, args, kwargs):
        step = get_step()
        if step is not None:
            step.before_layer(idx, args[0] if args else kwargs["hidden_states"])
        return None
    return hook


# A prepared 4-D mask makes transformers skip building its own (the kernel masks by position).
_MASK_UNUSED = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def run_step(model: torch.nn.Module, step: StepBatch, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One forward over a planned step, outside `generate`: the step is this thread's current step
    for the forward (`stepping`); the caller commits or aborts it.

    Returns the logits [len(logit_rows), vocab] of the given packed rows (with the model's final
    logit softcap, as its own forward applies it: Gemma 2), or, without `logit_rows`, the final
    hidden states [T, hidden] (no LM head: a pure restore pass).
    """
    with stepping(step):
        hidden = model.base_model(input_ids=step.input_ids, position_ids=step.position_ids,
                                  attention_mask=_MASK_UNUSED, use_cache=False).last_hidden_state[0]
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


def check_input_ids(input_ids, adapter: ModelAdapter) -> list[int]:
    """Validate one sequence of prompt ids; returns them as a list."""
    if not isinstance(input_ids, torch.Tensor):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be integer token ids, got {input_ids.dtype}")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"generate with a StatefulCache serves one session (batch size 1), got batch "
                             f"{input_ids.shape[0]}; use stateful_hf.Engine to serve many sessions together")
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be [1, n] or [n], got shape {tuple(input_ids.shape)}")
    ids = input_ids.tolist()
    if not ids:
        raise ValueError("empty prompt: input_ids has no tokens")
    bad = [t for t in ids if not 0 <= t < adapter.vocab_size]
    if bad:
        raise ValueError(f"invalid token ids {bad[:5]}: the model's vocabulary is 0..{adapter.vocab_size - 1}")
    if len(ids) >= adapter.max_positions:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of {adapter.max_positions}")
    return ids


def check_pad_ids(model, input_ids, ids: list[int], kwargs: dict) -> None:
    """Refuse where stateless `generate` would infer an attention mask that hides pad ids: a session's
    history has no holes, so the stateful path would attend to them and silently differ. The rule of
    transformers 5.23 (`_prepare_attention_mask_for_generation`, with the generation config
    `generate` would use): no attention_mask given, ids a 2-D int32/int64 tensor (or a list), the
    effective pad_token_id set and present in the ids, and no EOS id equal to it (an unset pad id
    defaults to the first EOS id, which is never inferred)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dtype not in (torch.int32, torch.int64):
        return
    config = _generation_config(model, kwargs)
    pad, eos = _id_list(config.pad_token_id), _id_list(config.eos_token_id)
    hidden = sorted(set(pad) & set(ids) - set(eos))
    if pad and hidden:
        raise ValueError(
            f"input_ids contain the pad token id {hidden[0]} and no attention_mask was given: stateless generate "
            "would infer a mask hiding those tokens, which a StatefulCache cannot do (a session's history has no "
            "holes). If the pad ids are meant as text, pass an all-ones attention_mask "
            "(attention_mask=torch.ones_like(input_ids)); otherwise remove the padding")


def _generation_config(model, kwargs: dict):
    """The generation config `generate(**kwargs)` would use (transformers' own merge, private API)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    rest = {k: v for k, v in kwargs.items() if k != "generation_config"}
    if prepare is not None:
        return prepare(kwargs.get("generation_config"), **rest)[0]
    # without it: the explicit kwargs over the given or the model's config
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**rest)
    return config


def _id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


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
    from .invariance import batch_invariant
    return batch_invariant(split)


# ---- the attention implementation and the step context ---------------------------------------------

NAME = "stateful"


def stateful_attention(
    module: torch.nn.Module,
    query: torch.Tensor,   # [1, Hq, T, D]
    key: torch.Tensor,     # [1, Hkv, T, D]
    value: torch.Tensor,   # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [1, T, Hq, D]
    """`scaling` (Gemma: query_pre_attn_scalar ** -0.5), `sliding_window` and `softcap` (Gemma 2:
    cap * tanh(logits / cap), applied to the scaled logits before the mask) are what the model's
    attention passes; a layer's window must be the one the store was made with (KVSpec.windows).
    The layer's `before_layer` already ran (its decoder layer's pre-hook): its swap-ins landed and its
    hidden chunks are rebuilt."""
    step = get_step()
    if step is None:
        if kwargs.get("softcap") is not None:   # SDPA cannot softcap
            return _softcapped(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    window, softcap = step.window(layer), kwargs.get("softcap")
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise RuntimeError(f"layer {layer} attends with sliding_window={kwargs['sliding_window']} but the "
                           f"store was made for window {window}: the model's adapter is out of date")
    if query.shape[0] != 1:
        raise ValueError("a stateful step packs all rows into batch dimension 1")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [T, H, D]
    key_cache, value_cache = step.pool.layer(layer)                  # [blocks, block_size, Hkv, D] views
    overlay = step.write_rows(layer, key_cache, value_cache, k, v)
    if step.dense_slots is not None:   # vAttention layout: contiguous per session, no block table
        key_slots, value_slots = step.pool.dense(layer)
        out = dense_attention(q, key_slots, value_slots, step.paged, list(step.dense_slots),
                              scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
                              window=window, softcap=softcap)
        return out.unsqueeze(0), None
    out = paged_attention(q, key_cache, value_cache, step.paged, scale=scaling, backend=step.backend,
                          window=window, validate=False, overlay=overlay, softcap=softcap, state=step.kernels)
    return out.unsqueeze(0), None


def _softcapped(query, key, value, attention_mask, scaling, softcap) -> torch.Tensor:   # [1, T, Hq, D]
    """Softcapped attention of an ordinary call over the SDPA-style mask transformers built for this
    implementation: a bool [B, 1, q, kv] mask (True = attend), or None where SDPA would use is_causal
    (q == kv, or one query row that sees every key)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        keys = torch.arange(kv_len, device=query.device)
        attention_mask = keys[None, :] <= torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    group = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = softcapped_attention(query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
                               attention_mask, scale, softcap)
    return out.transpose(1, 2)


def register() -> str:
    """Register the implementation (idempotent); returns its name for `set_attn_implementation`."""
    AttentionInterface.register(NAME, stateful_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


_STEP: ContextVar[StepBatch | None] = ContextVar("stateful_hf_step", default=None)


def get_step() -> StepBatch | None:
    """The step of the forward running on this thread; None outside one (an ordinary call)."""
    return _STEP.get()


def set_step(step: StepBatch | None) -> None:
    """Make `step` this thread's current step (None: an ordinary forward). Pair with `reset_step`."""
    _STEP.set(step)


def reset_step() -> None:
    """End this thread's current step (the forward returned or raised)."""
    _STEP.set(None)


@contextmanager
def stepping(step: StepBatch) -> Iterator[StepBatch]:
    """`step` is this thread's current step inside the block, and no longer after it, however it exits."""
    _STEP.set(step)
    try:
        yield step
    finally:
        _STEP.set(None)
