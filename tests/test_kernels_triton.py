"""The Triton kernel against the naive dense reference, under the Triton interpreter on the CPU.

TRITON_INTERPRET must be set before the kernel is decorated; stateful_hf/kernels/triton_backend.py decorates it on
first use, so setting it here (at collection, before any test runs) is enough even though triton itself
was imported earlier (transformers pulls it in). On a GPU machine the kernel is compiled for real, and
these tests are also marked `cuda`. No test module sets TRITON_INTERPRET where CUDA is available: one
module's setting would make every Triton test of the process interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_kernels import assert_close_to_reference, ragged_case, small_case

from stateful_hf import kernels
from stateful_hf.kernels import PagedBatch, paged_attention

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on CUDA the kernel compiles for real, and `pytest -m cuda` (gpu_check) runs these tests too
pytestmark = [pytest.mark.skipif(not kernels.triton_backend.available(DEVICE),
                                 reason="triton cannot run here (no CUDA and TRITON_INTERPRET=0)"),
              *([pytest.mark.cuda] if DEVICE == "cuda" else [])]


def run_triton(query, kc, vc, batch, window):
    batch = batch.to(DEVICE)
    return paged_attention(query.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch, backend="triton",
                           window=window).cpu()


# 60 cases on a GPU (gpu_check); 30 under the CPU interpreter (~0.5 s a case; the same kernel code, the fixed
# cases below cover every head dim and block size)
@settings(max_examples=60 if DEVICE == "cuda" else 30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64, 80), max_len=40))
def test_triton_matches_dense_reference_fp32(case):
    query, kc, vc, batch, window = case
    assert not kc.is_contiguous()                 # a [layers, blocks, 2, bs, Hkv, D] pool view
    assert_close_to_reference(run_triton(query, kc, vc, batch, window), query, kc, vc, batch, window)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_triton_head_dims_and_block_sizes(d, bs):
    query, kc, vc, batch = small_case(d=d, bs=bs)
    for window in (None, 3):
        assert_close_to_reference(run_triton(query, kc, vc, batch, window), query, kc, vc, batch, window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision(dtype):
    query, kc, vc, batch = small_case(dtype=dtype, d=80)
    out = run_triton(query, kc, vc, batch, None)
    assert out.dtype == dtype
    assert_close_to_reference(out.float(), query.float(), kc.float(), vc.float(), batch, None,
                              atol=2e-2 if dtype == torch.bfloat16 else 5e-3)


def test_triton_plan_reused_and_unsupported_shapes_rejected():
    query, kc, vc, batch = small_case()
    dq, dk, dv, db = query.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), batch.to(DEVICE)
    plan = kernels.plan(db, block_size=16, backend="triton")
    assert plan.backend == "triton"
    out = paged_attention(dq, dk, dv, db, plan=plan)
    assert torch.equal(out, paged_attention(dq, dk, dv, db, plan=plan))
    assert_close_to_reference(out.cpu(), query, kc, vc, batch, None)
    query72, kc72, vc72, _ = small_case(d=72)
    with pytest.raises(ValueError, match="head_dim 72"):
        paged_attention(query72.to(DEVICE), kc72.to(DEVICE), vc72.to(DEVICE), db, backend="triton")


def _pooled(keys: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [L, 2, Hkv, D] laid out in a pool of block size `bs` (blocks in reverse order: paged for real),
    and its block table [1, n]."""
    n = -(-keys.shape[0] // bs)
    pool = torch.zeros(n, 2, bs, *keys.shape[2:])
    order = list(reversed(range(n)))
    for j, b in enumerate(order):
        part = keys[j * bs:(j + 1) * bs]
        pool[b, :, :part.shape[0]] = part.transpose(0, 1)
    return pool, torch.tensor([order])


@pytest.fixture
def per_row_dot(monkeypatch):
    """Under the interpreter, tl.dot is numpy's matmul, and OpenBLAS's AVX2 kernel sums a row in an order that
    depends on the row's place in the tile (10 of 16 rows differ bitwise when moved to row 0, on an EPYC);
    a GPU's MMA sums every output element alike. This fixture makes the interpreter's dot one sum over K per
    element, so the test checks the kernel's own order (its key steps), not the emulating BLAS's tiling."""
    if DEVICE == "cuda":
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert a.data.ndim == 2 and a.data.dtype == np.float32, "float32 2-D operands only (this test's kernel)"
        products = a.data[:, :, None] * b.data[None, :, :]          # [M, K, N]: each row summed alike over K
        return interpreter.TensorHandle(products.sum(axis=1, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def test_triton_fixed_split_is_invariant_to_batch_chunking_and_pool(per_row_dot):
    """With `split` fixed, a query row's output is bitwise the same computed alone, among more rows
    (another tile layout), in a chunked prefill, and over pools of block size 32 and 64; without it the
    steps follow the pool's block size and the 64-block pool's result differs (negative control)."""
    g = torch.Generator().manual_seed(3)
    length, hq, hkv, d = 100, 2, 1, 64
    kv = torch.randn(length, 2, hkv, d, generator=g)
    query = torch.randn(length, hq, d, generator=g)

    def run(rows: list[int], bs: int, split: int | None) -> torch.Tensor:
        pool, table = _pooled(kv, bs)
        batch = PagedBatch(cu_q=torch.tensor([0, len(rows)]), q_pos=torch.tensor(rows),
                           kv_len=torch.tensor([max(rows) + 1]), block_table=table).to(DEVICE)
        return kernels.triton_backend.triton_paged_attention(
            query[rows].to(DEVICE), pool[:, 0].to(DEVICE), pool[:, 1].to(DEVICE), batch, d ** -0.5, split=split).cpu()

    rows = list(range(60, 100))
    whole = run(rows, 32, 32)                                                       # one call, three tiles
    every = list(range(0, len(rows), 3))                                            # each place in a tile, alone
    assert torch.equal(whole[every], torch.cat([run([rows[i]], 32, 32) for i in every]))
    assert torch.equal(torch.cat([run(rows[:7], 32, 32), run(rows[7:], 32, 32)]), whole)    # chunked
    assert torch.equal(run(rows, 64, 32), whole)                                    # another pool
    assert not torch.equal(run(rows, 64, None), run(rows, 32, None))                # steps of 64 vs 32 keys
    with pytest.raises(ValueError, match="split 24"):
        run(rows, 32, 24)
