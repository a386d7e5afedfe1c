"""The one entry point: attention of packed ragged queries over a paged KV pool, plus the KV write."""

from __future__ import annotations

import torch

from .batch import PagedBatch
from .torch_backend import torch_paged_attention

BACKENDS = ("torch",)


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


def paged_attention(
    query: torch.Tensor,        # [T, Hq, D] packed rows of all sub-requests
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    batch: PagedBatch,
    scale: float | None = None,
    backend: str = "torch",
    window: int | None = None,
    validate: bool = True,
) -> torch.Tensor:              # [T, Hq, D]
    """Causal attention by absolute position: row t of sub-request i attends to that sub-request's
    keys at positions <= q_pos[t] (and > q_pos[t] - window when a sliding window is given)."""
    _check(query, key_cache, value_cache, batch)
    if validate:
        batch.validate(key_cache.shape[0], key_cache.shape[1])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if backend == "torch":
        return torch_paged_attention(query, key_cache, value_cache, batch, scale, window)
    raise ValueError(f"unknown paged attention backend {backend!r}; choose from {BACKENDS}")


def write_kv(
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer
    value_cache: torch.Tensor,
    key: torch.Tensor,          # [T, Hkv, D]
    value: torch.Tensor,
    slots: torch.Tensor,        # [T] int: block * block_size + offset of each row
) -> None:
    """Store each row's K/V at its slot (vLLM's reshape_and_cache)."""
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, offsets] = value.to(value_cache.dtype)
