"""Attention-logit softcapping (Gemma 2: s -> c * tanh(s / c) on the scaled logits, before the mask)
in every CPU-testable path: the batched torch kernel, the per-sub-request loop, the dense kernels of
the virtual layout, and the Triton kernel (interpreted on the CPU), against the float64 reference."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels import ragged_case, small_case

from stateful_hf import kernels
from stateful_hf.kernels import paged_attention
from stateful_hf.kernels.dense import dense_attention
from stateful_hf.kernels.torch_backend import dense_reference, torch_paged_attention

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before the Triton kernel is first built


def reference(query, kc, vc, batch, window, softcap):
    return dense_reference(query.double(), kc.double(), vc.double(), batch, query.shape[-1] ** -0.5, window,
                           softcap)


def dense_slots(kc, vc, batch):
    """The paged case laid out as vAttention's per-sub-request slots [S, max_kv, Hkv, D]."""
    _, kv_len = batch.host
    bs, width = kc.shape[1], max(max(kv_len, default=1), 1)
    ks = torch.zeros(len(kv_len), width, *kc.shape[2:], dtype=kc.dtype)
    vs = torch.zeros_like(ks)
    for i, n in enumerate(kv_len):
        blocks = batch.block_table[i, : -(-n // bs)]
        ks[i, :n] = kc[blocks].flatten(0, 1)[:n]
        vs[i, :n] = vc[blocks].flatten(0, 1)[:n]
    return ks, vs


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64, 80), max_len=48), st.sampled_from([0.5, 2.0, 30.0]))
def test_torch_and_dense_paths_softcap(case, softcap):
    query, kc, vc, batch, window = case
    want = reference(query, kc, vc, batch, window, softcap)
    batched = paged_attention(query, kc, vc, batch, backend="torch", window=window, softcap=softcap)
    loop = torch_paged_attention(query, kc, vc, batch, query.shape[-1] ** -0.5, window, softcap)
    ks, vs = dense_slots(kc, vc, batch)
    dense = dense_attention(query, ks, vs, batch, list(range(batch.num_seqs)), query.shape[-1] ** -0.5, window,
                            softcap)
    for out in (batched, loop, dense):
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_softcap_changes_the_result_and_is_validated():
    query, kc, vc, batch = small_case()
    capped = paged_attention(query * 4, kc, vc, batch, softcap=1.0)
    assert not torch.allclose(capped, paged_attention(query * 4, kc, vc, batch), atol=1e-3)
    torch.testing.assert_close(capped.double(), reference(query * 4, kc, vc, batch, None, 1.0), atol=1e-5, rtol=0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="softcap"):
            paged_attention(query, kc, vc, batch, softcap=bad)


triton = pytest.mark.skipif(not kernels.triton_backend.available("cuda" if torch.cuda.is_available() else "cpu"),
                            reason="triton cannot run here (no CUDA and TRITON_INTERPRET=0)")


@triton
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64,), max_len=40), st.sampled_from([0.5, 2.0]))
def test_triton_softcap(case, softcap):
    query, kc, vc, batch, window = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = paged_attention(query.to(dev), kc.to(dev), vc.to(dev), batch.to(dev), backend="triton", window=window,
                          softcap=softcap).cpu()
    torch.testing.assert_close(out.double(), reference(query, kc, vc, batch, window, softcap), atol=1e-5, rtol=0)
