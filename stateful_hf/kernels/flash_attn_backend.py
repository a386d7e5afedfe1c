"""flash-attn (FA2) backend: flash_attn_varlen_func over runs, paged when FA2 allows it.

Mask convention: FA2's causal mask is bottom-right aligned (row r of q_len rows over kv_len keys sits at
kv_len - q_len + r), so sub-requests are first cut into runs of consecutive positions (runs.py); each
run is one varlen sequence with kv_len' = its last position + 1. Window w (keys j > pos - w) is
window_size=(w - 1, 0), per call (each layer its own); a logit softcap c is FA2's softcap=c.

Layouts: q/out are [total_q, Hq, D] as we pack them (cu_seqlens_q = the runs' row offsets).
FA2 reads a paged cache only when page_block_size % 256 == 0 (flash_api.cpp checks it), so:
  - block_size % 256 == 0: k/v are our caches [num_blocks, block_size, Hkv, D] as FA2's paged
    (num_blocks, page_block_size, nheads_k, headdim), block_table [R, max_pages] int32 per run,
    cu_seqlens_k the runs' kv_len' prefix sums. No copy.
  - smaller blocks (our 16/32/64): each layer gathers the runs' keys into varlen [total_k, Hkv, D]
    tensors with one index per step (slot = block * block_size + offset, computed here once) and
    calls the dense varlen kernel. This is a copy of the context; prefer the flashinfer or triton
    backend for small pages.
FA2 computes in fp16/bf16 only.
"""

from __future__ import annotations

import torch

from .batch import PagedBatch
from .runs import as_int32, contiguous_runs, cuda_package_available, window_left

MAX_HEAD_DIM = 256          # flash_api.cpp: head_size <= 256 and head_size % 8 == 0 (we do not pad)
DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)     # FA2 runs on Ampere, Ada and Hopper (sm80+)


def available(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability sm80+ where flash_attn imports."""
    return cuda_package_available(device, "flash_attn") and \
        torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def supports(dtype: torch.dtype | None = None, head_dim: int | None = None,
             block_size: int | None = None) -> str | None:
    """None when this backend serves (dtype, head_dim, block_size), else why not; None arguments are
    not checked. Any block size works (paged when block_size % 256 == 0, else a gathered copy)."""
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} not in {DTYPES}"
    if head_dim is not None and (head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM):
        return f"head_dim {head_dim} is not a multiple of 8 up to {MAX_HEAD_DIM}"
    return None


class FlashAttnPlan:
    """Per-step metadata for flash_attn_varlen_func; reuse for every layer of the step."""

    def __init__(self, batch: PagedBatch, block_size: int):
        self.batch, self.block_size = batch, block_size
        device = batch.cu_q.device
        self.runs = contiguous_runs(batch)
        cu_k = [0]
        for n in self.runs.kv_len:
            cu_k.append(cu_k[-1] + n)
        self.cu_q = as_int32(self.runs.cu_q, device)
        self.cu_k = as_int32(cu_k, device)
        rows = self.runs.block_rows(batch, block_size)
        self.paged = block_size % 256 == 0
        if self.paged:
            width = max((len(r) for r in rows), default=1)
            self.block_table = as_int32([r + [r[0]] * (width - len(r)) for r in rows], device).view(len(rows), width)
        else:
            # [total_k] (block, offset) of every key of every run, in run order
            blocks, offsets = [], []
            for row, n in zip(rows, self.runs.kv_len):
                blocks += [row[j // block_size] for j in range(n)]
                offsets += [j % block_size for j in range(n)]
            self.key_blocks = torch.tensor(blocks, dtype=torch.long, device=device)
            self.key_offsets = torch.tensor(offsets, dtype=torch.long, device=device)

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]  ->  [T, Hq, D]
        from flash_attn import flash_attn_varlen_func

        if query.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flash_attn backend computes in fp16/bf16, got {query.dtype}; use torch or triton")
        if query.shape[0] == 0:
            return torch.empty_like(query)
        common = dict(
            cu_seqlens_q=self.cu_q, cu_seqlens_k=self.cu_k,
            max_seqlen_q=self.runs.max_q, max_seqlen_k=self.runs.max_kv,
            softmax_scale=scale, causal=True, window_size=(window_left(window), 0 if window else -1),
        )
        if softcap is not None:   # FA2 >= 2.6: c * tanh(scaled logits / c)
            common["softcap"] = softcap
        if self.paged:
            return flash_attn_varlen_func(query, key_cache, value_cache, block_table=self.block_table, **common)
        k = key_cache[self.key_blocks, self.key_offsets]     # [total_k, Hkv, D]
        v = value_cache[self.key_blocks, self.key_offsets]
        return flash_attn_varlen_func(query, k, v, **common)
