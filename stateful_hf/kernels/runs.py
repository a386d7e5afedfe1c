"""Split sub-requests into runs that a bottom-right-aligned causal kernel can serve exactly.

FlashInfer and flash-attn place query row r of a sequence with q_len rows and kv_len keys at position
kv_len - q_len + r ("causal aligned to the bottom right"). Our rows carry absolute positions that need
not be contiguous or sorted (a dropped-prefix recompute and a new prompt of one session, rows in any
order). The trick: cut every sub-request into maximal runs of consecutive packed rows whose positions
rise by exactly 1, and give each run its own sequence with kv_len' = last position + 1 and the same
block table row. Row r of a run then sits at kv_len' - q_len' + r = its own q_pos, and the keys the run
drops (positions >= kv_len') are exactly the ones causality hides from it anyway. Runs keep the packed
row order, so the query and output tensors are passed through unpermuted. A sliding window of w keys
(j > pos - w) is the kernels' inclusive left window w - 1.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from .batch import PagedBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runs:
    """R runs over the packed rows, host lists (built once per step)."""

    cu_q: list[int]     # [R + 1] packed row offsets of each run
    seq: list[int]      # [R] sub-request each run belongs to
    kv_len: list[int]   # [R] keys the run needs: its last position + 1

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.cu_q, self.cu_q[1:])), default=0)

    @property
    def max_kv(self) -> int:
        return max(self.kv_len, default=0)

    def pages(self, block_size: int) -> list[int]:
        return [-(-n // block_size) for n in self.kv_len]

    def block_rows(self, batch: PagedBatch, block_size: int) -> list[list[int]]:
        """Per run, the block ids covering its kv_len (a prefix of its sub-request's table row)."""
        table = batch.block_table.cpu()
        return [table[s, :p].tolist() for s, p in zip(self.seq, self.pages(block_size))]


def contiguous_runs(batch: PagedBatch) -> Runs:
    cu_q, _ = batch.host
    pos = batch.q_pos.cpu().tolist()
    starts, seqs, kvs = [], [], []
    for i, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
        for t in range(a, b):
            if t > a and pos[t] == pos[t - 1] + 1:
                continue                          # extends the current run
            if t > a:
                kvs.append(pos[t - 1] + 1)        # close the previous run of this sub-request
            starts.append(t)
            seqs.append(i)
        if b > a:
            kvs.append(pos[b - 1] + 1)
    return Runs(cu_q=starts + [cu_q[-1]], seq=seqs, kv_len=kvs)


def window_left(window: int | None) -> int:
    """Our window w (keys j > pos - w) as the kernels' inclusive left window; -1 = none."""
    return -1 if window is None else window - 1


def as_int32(xs: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=device)


def cuda_package_available(device: torch.device | str, package: str) -> bool:
    """True when `device` is a CUDA device here and `package` imports (the GPU backends' gate)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    return package_imports(package)


def package_imports(package: str) -> bool:
    """True when `package` imports. An optional package that fails in any way (ImportError, or a
    half-installed one's OSError, RuntimeError, AttributeError, ...) counts as absent; a failure
    other than the package missing is logged once per package and reason."""
    try:
        importlib.import_module(package)
    except ModuleNotFoundError as e:
        if e.name != package:                # installed, but a dependency of it is missing
            log_import_failure(package, f"{type(e).__name__}: {e}")
        return False
    except Exception as e:                   # any failure means absent: a backend's gate never crashes a store
        log_import_failure(package, f"{type(e).__name__}: {e}")
        return False
    return True


@functools.cache
def log_import_failure(package: str, reason: str) -> None:
    """Log that `package` is present but failed to import (cached: once per package and reason)."""
    logger.warning("%s fails to import (%s); treated as absent", package, reason)
