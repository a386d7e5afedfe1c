"""The one entry point: attention of packed ragged queries over a paged KV pool. Writing K/V into
the pool is the store's (`stateful_hf/cache/kv_writer.py`)."""

from __future__ import annotations

import torch

from .batch import Overlay, PagedBatch
from .kernel_plan import BACKENDS, KernelPlan, KernelState, plan_for

__all__ = ["BACKENDS", "paged_attention"]


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch) -> None:
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"paged_attention: query must be [T, Hq, D] and caches [blocks, block_size, Hkv, D], "
                         f"got {tuple(query.shape)} and {tuple(key_cache.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: key cache {tuple(key_cache.shape)} "
                         f"!= value cache {tuple(value_cache.shape)}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"paged_attention: dtypes differ: query {query.dtype}, key cache {key_cache.dtype}, "
                        f"value cache {value_cache.dtype}")
    hq, d = query.shape[1:]
    hkv, dk = key_cache.shape[2:]
    if d != dk or hq % hkv:
        raise ValueError(f"paged_attention: query has {hq} heads of dim {d}, cache {hkv} heads of dim {dk}; "
                         "head dims must match and query heads be a multiple of KV heads")
    if query.shape[0] != batch.num_tokens:
        raise ValueError(f"paged_attention: query has {query.shape[0]} rows, batch describes {batch.num_tokens}")
    devices = {query.device, key_cache.device, value_cache.device, batch.cu_q.device, batch.block_table.device}
    if len(devices) > 1:
        raise ValueError("paged_attention: query, caches and batch must be on one device, "
                         f"got {sorted(map(str, devices))}")


def paged_attention(
    query: torch.Tensor,        # [T, Hq, D] packed rows of all sub-requests
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer (strided views are fine)
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    batch: PagedBatch,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    validate: bool = True,
    plan: KernelPlan | None = None,
    overlay: Overlay | None = None,
    softcap: float | None = None,
    state: KernelState | None = None,
) -> torch.Tensor:              # [T, Hq, D]
    """Causal attention by absolute position: row t of sub-request i attends to that sub-request's
    keys at positions <= q_pos[t] (and > q_pos[t] - window when a sliding window is given).
    `softcap` c: the scaled logits s become c * tanh(s / c) before masking and softmax (Gemma 2).

    `plan` (kernels.plan(batch, block_size, backend), made once per step) carries the backend's
    per-batch work; without one, the plan is made on the first call and cached on the batch, so
    later layers of the same step reuse it. Validation runs once per plan and pool size.
    `overlay` reads some context blocks of this layer from another tensor (torch backend only).
    `state` (a KernelState kept by the caller across steps) holds FlashInfer's workspace and wrapper."""
    _check(query, key_cache, value_cache, batch)
    if overlay is not None:
        _check_overlay(overlay, key_cache, batch)
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"paged_attention: softcap must be > 0 or None, got {softcap}")
    num_blocks, block_size = key_cache.shape[:2]
    if plan is None:
        plan = plan_for(batch, block_size, backend, query.dtype, state, head_dim=query.shape[-1])
    elif plan.batch is not batch or plan.block_size != block_size:
        raise ValueError("paged_attention: the plan was made for another batch or block size")
    elif backend != "auto" and backend != plan.backend:
        raise ValueError(f"paged_attention: backend {backend!r} but the plan is for {plan.backend!r}")
    if validate and plan.validated_for != num_blocks:
        batch.validate(num_blocks, block_size)
        plan.validated_for = num_blocks
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return plan.run(query, key_cache, value_cache, scale, window, overlay, softcap)


def _check_overlay(overlay: Overlay, key_cache: torch.Tensor, batch: PagedBatch) -> None:
    if overlay.table.shape != batch.block_table.shape:
        raise ValueError(f"paged_attention: overlay table {tuple(overlay.table.shape)} must match the block table "
                         f"{tuple(batch.block_table.shape)}")
    if overlay.key.shape[1:] != key_cache.shape[1:] or overlay.key.dtype != key_cache.dtype \
            or overlay.key.device != key_cache.device:
        raise ValueError(f"paged_attention: overlay blocks {tuple(overlay.key.shape[1:])} {overlay.key.dtype} on "
                         f"{overlay.key.device} must match the cache's {tuple(key_cache.shape[1:])} "
                         f"{key_cache.dtype} on {key_cache.device}")

