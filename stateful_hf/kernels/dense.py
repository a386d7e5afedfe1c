"""Dense attention over per-session contiguous KV (vAttention's layout): no block table, no gather.

Sub-request i reads rows 0 .. kv_len[i] - 1 of its slot of `[slots, max_context, Hkv, D]` caches
as one contiguous tensor, masked by absolute position like every backend. Few query rows (decode)
use one grouped matmul per KV head (the query heads of a group share their K/V, which CPU SDPA
with GQA would copy per head); longer ones run SDPA, except with a logit softcap (SDPA has none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import PagedBatch


def dense_attention(
    query: torch.Tensor,        # [T, Hq, D] packed rows
    key_slots: torch.Tensor,    # [slots, max_context, Hkv, D] one layer
    value_slots: torch.Tensor,  # [slots, max_context, Hkv, D]
    batch: PagedBatch,
    slots: list[int],           # slot of each sub-request
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:              # [T, Hq, D]
    cu_q, kv_len = batch.host
    if len(slots) != len(kv_len):
        raise ValueError(f"dense_attention: {len(slots)} slots for {len(kv_len)} sub-requests")
    if max(kv_len, default=0) > key_slots.shape[1]:
        raise ValueError(f"dense_attention: context {max(kv_len)} exceeds the slots' {key_slots.shape[1]} rows")
    out = torch.empty_like(query)
    gqa = query.shape[1] != key_slots.shape[2]
    for i, (slot, kv) in enumerate(zip(slots, kv_len)):
        a, b = cu_q[i], cu_q[i + 1]
        if a == b:
            continue
        k = key_slots[slot, :kv].transpose(0, 1)      # [Hkv, kv, D] view, no copy
        v = value_slots[slot, :kv].transpose(0, 1)
        pos = batch.q_pos[a:b]
        key_pos = torch.arange(kv, device=query.device)
        mask = key_pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= key_pos[None, :] > pos[:, None] - window
        if b - a <= GROUPED_ROWS or softcap is not None:
            out[a:b] = _grouped(query[a:b], k, v, mask, scale, softcap)
            continue
        o = F.scaled_dot_product_attention(query[a:b].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        out[a:b] = o.transpose(0, 1)
    return out


GROUPED_ROWS = 16


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
             softcap: float | None = None) -> torch.Tensor:
    """q [n, Hq, D]; k, v [Hkv, kv, D] (views); mask [n, kv] -> [n, Hq, D]."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)         # rows: (head in group, row)
    s = torch.matmul(qg, k.transpose(1, 2)) * scale                                # [Hkv, g*n, kv]
    if softcap is not None:                                                        # Gemma 2: c * tanh(s / c)
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask.repeat(g, 1), float("-inf"))
    o = torch.matmul(s.softmax(-1), v)                                             # [Hkv, g*n, D]
    return o.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
