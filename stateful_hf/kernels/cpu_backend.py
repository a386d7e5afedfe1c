"""The CPU backend: paged attention that reads K/V blocks in place (no per-layer gather), in C++.

`csrc/paged_attention_cpu.cpp` is built from source on first use with `torch.utils.cpp_extension`
(g++, -O3 -march=native: this machine's vector units) and cached on disk (`extension.py`: under
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, named by a hash of the source, the CPU's flags,
torch and Python), so a later process imports it in milliseconds. Never a downloaded binary. If it
does not build (no compiler), `available` says why and "auto" keeps the torch backend.

Each work item is (sub-request, tile of up to ROWS query rows, KV head); per query row and head the
arithmetic is fixed (scores over one block of the pool, online softmax over blocks in ascending order,
float32 accumulation), so a row's result does not depend on the rest of the batch or the thread count.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from .batch import PagedBatch
from .cpu_features import CpuFeatures
from .extension import load_or_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
ROWS = 16                    # query rows of one sub-request per work item (they share each K/V block)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _build():
    """(module, None) once built or loaded from the cache, else (None, why)."""
    try:
        module = load_or_build("stateful_hf_paged_attention", [SOURCE], cflags=["-O3", "-march=native", "-fopenmp"],
                               ldflags=["-fopenmp"], key=repr(CpuFeatures.detect()))
        return module, None
    except Exception as e:                                      # noqa: BLE001 - any build failure: not available
        why = f"the C++ kernel did not build: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:200]}"
        logger.warning("CPU paged attention unavailable: %s", why)
        return None, why


def supports(dtype: torch.dtype | None, head_dim: int | None, block_size: int | None) -> str | None:
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} not in {tuple(str(d).removeprefix('torch.') for d in DTYPES)}"
    return None


def available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and _build()[0] is not None


def unavailable_reason() -> str | None:
    return _build()[1]


class CpuPlan:
    """Per-step state: the work items and the int64 metadata every layer of the step passes."""

    def __init__(self, batch: PagedBatch, block_size: int, split: int | None = None,
                 members: Sequence[int] | None = None):
        # members: the sub-requests attended (None: all); the others' rows of the output are zero
        cu_q, _ = batch.host
        items = [(i, a, min(a + ROWS, cu_q[i + 1])) for i in (range(batch.num_seqs) if members is None else members)
                 for a in range(cu_q[i], cu_q[i + 1], ROWS)]
        self.items = torch.tensor(items, dtype=torch.long).reshape(-1, 3)
        self.q_pos = batch.q_pos.to(torch.long).contiguous()
        self.kv_len = batch.kv_len.to(torch.long).contiguous()
        self.table = batch.block_table.to(torch.long).contiguous()
        self.module = _build()[0]
        self.split = split or block_size       # keys per online-softmax step; divides the block size
        if block_size % self.split:
            raise ValueError(f"the CPU kernel's split {self.split} must divide the block size {block_size}")

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        # query [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] (strided views are fine) -> [T, Hq, D]
        if query.stride(-1) != 1:
            query = query.contiguous()
        return self.module.paged_attention(query, key_cache, value_cache, self.items, self.q_pos, self.kv_len,
                                           self.table, scale, window or 0, softcap or 0.0, self.split)
