"""FlashInfer backend: BatchPrefillWithPagedKVCacheWrapper, planned once per step, run by every layer.

Layout mapping (FlashInfer "NHD"): our per-layer caches [num_blocks, block_size, Hkv, D] are FlashInfer's
[max_num_pages, page_size, num_kv_heads, head_dim]; they are passed as the tuple (key_cache, value_cache)
and FlashInfer reads them through their strides, so `pool[l, :, 0]` views need no copy.
Page table in CSR form, per run (see runs.py: sub-requests are cut into runs of consecutive positions
because FlashInfer's causal mask is bottom-right aligned):
    paged_kv_indptr[r+1] - paged_kv_indptr[r] = ceil(kv_len'_r / block_size)
    paged_kv_indices = the concatenated prefixes of the block table rows
    paged_kv_last_page_len[r] = kv_len'_r - (pages_r - 1) * block_size      (1 .. block_size)
Sliding window w (keys j > pos - w) = FlashInfer's inclusive window_left = w - 1 (planned per
window: a model with sliding and global layers passes each layer's own). Softcap c = FlashInfer's
logits_soft_cap (c * tanh(scaled logits / c), as vLLM uses it for Gemma 2).
FlashInfer computes in fp16/bf16 only; fp32 callers must use the torch or triton backend.
"""

from __future__ import annotations

import torch

from .batch import PagedBatch
from .runs import as_int32, contiguous_runs, cuda_package_available, window_left

WORKSPACE_BYTES = 128 * 1024 * 1024   # FlashInfer's recommended float workspace
# FlashInfer's prefill kernels are instantiated for these head dims only (DISPATCH_HEAD_DIM in its
# dispatch.cuh; head dims not divisible by 64 fail at run time, flashinfer-ai/flashinfer#528).
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)   # q and KV dtypes this backend plans (FlashInfer's fp8 KV unused)


def available(device: torch.device | str) -> bool:
    return cuda_package_available(device, "flashinfer")


def supports(dtype: torch.dtype | None = None, head_dim: int | None = None,
             block_size: int | None = None) -> str | None:
    """None when this backend serves (dtype, head_dim, block_size), else why not; None arguments are
    not checked. Any page size works: the CSR page table carries each run's last page length."""
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} not in {DTYPES}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    return None


def new_workspace(device: torch.device | str) -> torch.Tensor:
    """A float workspace buffer; keep one per engine and pass it to every step's plan."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class FlashInferWrapper:
    """The long-lived half: one workspace and one BatchPrefillWithPagedKVCacheWrapper, kept per store
    (kernels.KernelState) and re-planned by each step's FlashInferPlan. `planned`: (plan, shape) of
    the last plan() call, so a step's layers of one shape plan once."""

    def __init__(self, device: torch.device | str, workspace: torch.Tensor | None = None):
        import flashinfer

        self.workspace = new_workspace(device) if workspace is None else workspace
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.planned: tuple | None = None


class FlashInferPlan:
    """One step's batch planned on a FlashInferWrapper for one (heads, dim, dtype, scale, window,
    softcap) shape. Without `shared`, a wrapper of its own (over `workspace` if given) is made."""

    def __init__(self, batch: PagedBatch, block_size: int, workspace: torch.Tensor | None = None,
                 shared: FlashInferWrapper | None = None):
        self.batch, self.block_size = batch, block_size
        device = batch.cu_q.device
        self.runs = contiguous_runs(batch)
        pages = self.runs.pages(block_size)
        rows = self.runs.block_rows(batch, block_size)
        indptr = [0]
        for p in pages:
            indptr.append(indptr[-1] + p)
        last = [n - (p - 1) * block_size for n, p in zip(self.runs.kv_len, pages)]
        self.qo_indptr = as_int32(self.runs.cu_q, device)
        self.kv_indptr = as_int32(indptr, device)
        self.kv_indices = as_int32([b for row in rows for b in row], device)
        self.last_page_len = as_int32(last, device)
        self.shared = shared if shared is not None else FlashInferWrapper(device, workspace)

    def _plan(self, query: torch.Tensor, key_cache: torch.Tensor, scale: float, window: int | None,
              softcap: float | None) -> None:
        shape = (query.shape[1], key_cache.shape[2], query.shape[2], query.dtype, scale, window, softcap)
        if self.shared.planned == (self, shape):
            return      # every later layer of the step with the same window reuses the plan (Gemma's
            #             alternating sliding/global layers re-plan at each change: correct, not fastest)
        hq, hkv, d, dtype = shape[:4]
        self.shared.planned = None
        self.shared.wrapper.plan(
            self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len,
            hq, hkv, d, self.block_size,
            causal=True, sm_scale=scale, window_left=window_left(window), logits_soft_cap=softcap,
            q_data_type=dtype, kv_data_type=key_cache.dtype,
        )
        self.shared.planned = (self, shape)

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]  ->  [T, Hq, D]
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flashinfer backend computes in fp16/bf16, got {query.dtype}; use torch or triton")
        if query.shape[0] == 0:
            return torch.empty_like(query)
        self._plan(query, key_cache, scale, window, softcap)
        return self.shared.wrapper.run(query, (key_cache, value_cache))
