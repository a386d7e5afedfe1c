"""The `stateful` attention implementation registered with transformers' `AttentionInterface`.

It reads this thread's step (`context.get_step`), has the step write each row's K/V (`StepBatch.write_rows`,
the one K/V writer) and attends through the paged kernel. Without a step (any ordinary call of the same
model) it is plain SDPA, or the model's eager attention when it softcaps logits. Traced by `torch.compile`
(the engine's compiled step) it is two opaque ops instead, `step_ops.write_kv` and `step_ops.attention`,
whose bodies read the step outside the graph."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kernels.torch_batched import softcapped_attention
from . import step_ops
from .context import current_step

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
    hidden chunks are rebuilt. The first layer to attend goes through `paged_attention`'s checks with the step's
    plan; a later layer with the same shapes and no overlay runs the plan directly."""
    if torch.compiler.is_compiling():       # the compiled step: no step context read in the graph
        return _traced(module, query, key, value, scaling, kwargs), None
    current = current_step()
    if current is None:
        if kwargs.get("softcap") is not None:   # SDPA cannot softcap
            return _softcapped(query, key, value, attention_mask, scaling, kwargs["softcap"]), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    step = current.step
    layer = module.layer_idx
    window, softcap = step.window(layer), kwargs.get("softcap")
    if "sliding_window" in kwargs and kwargs["sliding_window"] != window:
        raise RuntimeError(f"layer {layer} attends with sliding_window={kwargs['sliding_window']} but the "
                           f"store was made for window {window}: the model's adapter is out of date")
    if query.shape[0] != 1:
        raise ValueError("a stateful step packs all rows into batch dimension 1")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)   # [T, H, D]
    key_cache, value_cache = step.pool.layer(layer)                  # [blocks, block_size, Hkv, D] views
    overlay = step.write_rows(layer, key_cache, value_cache, k, v)
    return current.attend(layer, q, key_cache, value_cache, scaling, window, softcap, overlay).unsqueeze(0), None


def _traced(module, query, key, value, scaling, kwargs) -> torch.Tensor:   # [1, T, Hq, D]
    """The attention as the compiled step's graph has it: the layer's write and attention as two custom ops
    (`step_ops`), constants and tensors only."""
    if query.shape[0] != 1:
        raise ValueError("a stateful step packs all rows into batch dimension 1")
    layer = module.layer_idx
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))   # [T, H, D]
    dep = step_ops.write_kv(k, v, layer)
    window = kwargs.get("sliding_window", step_ops.NO_WINDOW_ARG)
    out = step_ops.attention(q, dep, layer, scaling, kwargs.get("softcap"), window)
    return out.unsqueeze(0)


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
