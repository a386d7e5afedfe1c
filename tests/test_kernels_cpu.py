"""The CPU backend (kernels/cpu_backend.py, csrc/paged_attention_cpu.cpp): K/V read in place from the pool,
against the float64 reference on random ragged batches (strided pools whose unused slots hold NaN, GQA,
windows, softcaps, recomputed prefixes beside new rows, bf16), and each row's result bitwise the same alone,
inside any batch and at any thread count (the fixed split the batch-invariance work builds on)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round
from hypothesis import HealthCheck, given, settings
from test_kernels import assert_close_to_reference, ragged_case

from stateful_hf import Engine, kernels
from stateful_hf.kernels import PagedBatch, paged_attention
from stateful_hf.kernels.cpu_backend import available, unavailable_reason
from stateful_hf.kernels.torch_backend import dense_reference
from stateful_hf.testing import tiny_gemma2

pytestmark = pytest.mark.skipif(not available("cpu"), reason=f"CPU kernel not built: {unavailable_reason()}")


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64, 80, 16), max_len=70))
def test_cpu_kernel_matches_dense_reference(case):
    query, kc, vc, batch, window = case
    assert not kc.is_contiguous()
    out = paged_attention(query, kc, vc, batch, backend="cpu", window=window)
    assert_close_to_reference(out, query, kc, vc, batch, window)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64,), max_len=50))
def test_cpu_kernel_softcap_and_bf16(case):
    query, kc, vc, batch, window = case
    scale = query.shape[-1] ** -0.5
    ref = dense_reference(query.double(), kc.double(), vc.double(), batch, scale, window, softcap=5.0)
    out = paged_attention(query, kc, vc, batch, backend="cpu", window=window, softcap=5.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (query, kc, vc))
    ref16 = dense_reference(q16.double(), k16.double(), v16.double(), batch, scale, window)
    out16 = paged_attention(q16, k16, v16, batch, backend="cpu", window=window)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), ref16, atol=2e-2, rtol=0)


def _one(batch: PagedBatch, i: int, rows: slice) -> PagedBatch:
    """Sub-request i of `batch` alone, with only the query rows `rows` (absolute row indices)."""
    return PagedBatch(cu_q=torch.tensor([0, rows.stop - rows.start]), q_pos=batch.q_pos[rows],
                      kv_len=batch.kv_len[i: i + 1], block_table=batch.block_table[i: i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=ragged_case(head_dims=(64,), max_len=70))
def test_a_row_is_bitwise_the_same_alone_in_a_batch_and_at_any_thread_count(dtype, case):
    query, kc, vc, batch, window = case
    query, kc, vc = (t.to(dtype) for t in (query, kc, vc))
    together = paged_attention(query, kc, vc, batch, backend="cpu", window=window)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = paged_attention(query, kc, vc, batch, backend="cpu", window=window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    cu_q = batch.host[0]
    for i in range(batch.num_seqs):
        rows = slice(cu_q[i], cu_q[i + 1])
        if rows.stop > rows.start:
            assert torch.equal(paged_attention(query[rows], kc, vc, _one(batch, i, rows), backend="cpu",
                                               window=window), together[rows])
            last = slice(rows.stop - 1, rows.stop)              # the last row alone: a tile of one row
            assert torch.equal(paged_attention(query[last], kc, vc, _one(batch, i, last), backend="cpu",
                                               window=window), together[last])


def test_negative_control_a_different_split_changes_the_bits():
    """The comparisons above are not vacuous: bitwise equality is sensitive to the accumulation order. The
    same K/V laid out in blocks of 16 and of 32 (the kernel's split is the block) gives the same values
    to float32 rounding but not the same bits on a long context."""
    g = torch.Generator().manual_seed(0)
    hkv, d, n = 2, 64, 200
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    q = torch.randn(4, 4, d, generator=g)
    outs = []
    for bs in (16, 32):
        blocks = -(-n // bs)
        pool = torch.zeros(blocks, 2, bs, hkv, d)
        for kind, src in ((0, k), (1, v)):
            flat = torch.zeros(blocks * bs, hkv, d)
            flat[:n] = src
            pool[:, kind] = flat.view(blocks, bs, hkv, d)
        batch = PagedBatch(cu_q=torch.tensor([0, 4]), q_pos=torch.tensor([n - 4, n - 3, n - 2, n - 1]),
                           kv_len=torch.tensor([n]), block_table=torch.arange(blocks)[None])
        outs.append(paged_attention(q, pool[:, 0], pool[:, 1], batch, backend="cpu"))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert not torch.equal(outs[0], outs[1])


def test_the_cpu_kernel_is_chosen_by_name_and_refuses_what_it_cannot_serve():
    assert kernels.select_backend("auto", "cpu", torch.float32, 64, 32).name == "torch"
    assert kernels.select_backend("cpu", "cpu", torch.bfloat16, 64, 32).name == "cpu"
    with pytest.raises(ValueError, match="layerwise_kv needs attn_backend='torch'"):
        kernels.select_backend("cpu", "cpu", torch.float32, 64, 32, layerwise_kv=True)
    with pytest.raises(RuntimeError, match="cpu backend unavailable on cuda"):
        kernels.select_backend("cpu", "cuda", torch.float32, 64, 32)
    with pytest.raises(ValueError, match=r"attn_backend='cpu' unsupported here: dtype torch.float64"):
        kernels.select_backend("cpu", "cpu", torch.float64, 64, 32)


@pytest.mark.parametrize("make_model", [lambda: FAMILIES["mistral"](), lambda: FAMILIES["opt"](),
                                        lambda: tiny_gemma2()], ids=["mistral", "opt", "gemma2"])
def test_engine_on_the_cpu_kernel_is_exact(make_model):
    """Through the engine (prefill chunks, decode rows, returning turns; Mistral's sliding window, Gemma 2's
    softcaps and windows) the kernel gives stateless generate's tokens."""
    model, oracle = make_model(), make_model()
    engine = Engine(model, device_capacity=512, chunk_size=16, max_batch_tokens=48, attn_backend="cpu")
    assert engine.store.attn_backend == "cpu"
    convs = {f"s{i}": Conversation(seed=500 + i, first=10 + 7 * i) for i in range(5)}
    for _ in range(2):
        engine_round(engine, convs, oracle, 6)
        engine.store.check_integrity()
