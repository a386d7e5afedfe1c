"""The attention implementation registered with transformers: writes each row's K/V into the
session blocks of the step and attends through the paged kernel. Without a step (any ordinary call
of the same model) it is plain SDPA, or the model's eager attention when it softcaps logits."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache.step import StepBatch
from .kernels import paged_attention, write_kv
from .kernels.dense import dense_attention
from .kernels.torch_batched import softcapped_attention

NAME = "stateful"


def stateful_attention(
    module: torch.nn.Module,
    query: torch.Tensor,   # [1, Hq, T, D]
    key: torch.Tensor,     # [1, Hkv, T, D]
    value: torch.Tensor,   # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    stateful_step: StepBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [1, T, Hq, D]
    """`scaling` (Gemma: query_pre_attn_scalar ** -0.5), `sliding_window` and `softcap` (Gemma 2:
    cap * tanh(logits / cap), applied to the scaled logits before the mask) are what the model's
    attention passes; a layer's window must be the one the store was made with (KVSpec.windows)."""
    if stateful_step is None:
        if kwargs.get("softcap") is not None:   # SDPA cannot softcap
            return _softcapped(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    window, softcap = stateful_step.window(module.layer_idx), kwargs.get("softcap")
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise RuntimeError(f"layer {module.layer_idx} attends with sliding_window={kwargs['sliding_window']} but the "
                           f"store was made for window {window}: the model's adapter is out of date")
    if query.shape[0] != 1:
        raise ValueError("a stateful step packs all rows into batch dimension 1")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [T, H, D]
    key_cache, value_cache = stateful_step.layer_kv(module.layer_idx)
    overlay = None
    if stateful_step.layered is None:
        write_kv(key_cache, value_cache, k, v, stateful_step.slots)
    else:   # LayerKV: each row's K/V goes where this layer of its chunk lives; host-resident context is read there
        overlay = stateful_step.layered.write_and_overlay(module.layer_idx, key_cache, value_cache, k, v)
    if stateful_step.dense_slots is not None:   # vAttention layout: contiguous per session, no block table
        key_slots, value_slots = stateful_step.pool.dense(module.layer_idx)
        out = dense_attention(q, key_slots, value_slots, stateful_step.paged, list(stateful_step.dense_slots),
                              scale=scaling if scaling is not None else q.shape[-1] ** -0.5,
                              window=window, softcap=softcap)
        return out.unsqueeze(0), None
    out = paged_attention(q, key_cache, value_cache, stateful_step.paged, scale=scaling,
                          backend=stateful_step.backend, window=window, validate=False,
                          overlay=overlay, softcap=softcap, state=stateful_step.kernels)
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
