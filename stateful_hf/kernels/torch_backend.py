"""Pure-torch paged attention: the reference every other backend is tested against.

Per sub-request it gathers the context's blocks and runs SDPA with an explicit mask aligned to
absolute positions (SDPA's own `is_causal` aligns top-left, which is wrong when q_len < kv_len).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import PagedBatch
from .torch_batched import softcapped_attention


def torch_paged_attention(
    query: torch.Tensor,        # [T, Hq, D]
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:              # [T, Hq, D]
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    cu_q, kv_len = batch.host
    for i, kv in enumerate(kv_len):
        a, b = cu_q[i], cu_q[i + 1]
        if a == b:
            continue
        n_blocks = -(-kv // block_size)
        blocks = batch.block_table[i, :n_blocks]
        k = key_cache[blocks].flatten(0, 1)[:kv]      # [kv, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:kv]
        pos = batch.q_pos[a:b]
        key_pos = torch.arange(kv, device=query.device)
        mask = key_pos[None, :] <= pos[:, None]       # [q, kv]
        if window is not None:
            mask &= key_pos[None, :] > pos[:, None] - window
        if softcap is not None:
            group = query.shape[1] // k.shape[1]
            o = softcapped_attention(query[a:b].transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0),
                                     v.transpose(0, 1).repeat_interleave(group, 0), mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(
                query[a:b].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != k.shape[1],
            )
        out[a:b] = o.transpose(0, 1)
    return out


def dense_reference(query, key_cache, value_cache, batch: PagedBatch, scale: float, window=None, softcap=None):
    """Naive float64 softmax(QK^T)V per row: the independent oracle for kernel tests."""
    block_size = key_cache.shape[1]
    cu_q, kv_len = batch.host
    group = query.shape[1] // key_cache.shape[2]
    out = torch.zeros_like(query)
    for i, kv in enumerate(kv_len):
        for t in range(cu_q[i], cu_q[i + 1]):
            p = int(batch.q_pos[t])
            keys = [j for j in range(kv) if j <= p and (window is None or j > p - window)]
            if not keys:
                continue
            blk = batch.block_table[i, [j // block_size for j in keys]]
            off = torch.tensor([j % block_size for j in keys])
            k = key_cache[blk, off].double().repeat_interleave(group, dim=1)   # [n, Hq, D]
            v = value_cache[blk, off].double().repeat_interleave(group, dim=1)
            s = torch.einsum("hd,nhd->hn", query[t].double(), k) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[t] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(query.dtype)
    return out
