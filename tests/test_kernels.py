"""Paged attention kernels: the torch paths, the runs trick of the GPU backends, metadata errors, backend
choice, and (when CUDA and the packages are present) FlashInfer and flash-attn, all against the naive
float64 `dense_reference`. Batch helpers here are shared with test_kernels_triton.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stateful_hf import kernels
from stateful_hf.kernels import PagedBatch, paged_attention
from stateful_hf.kernels.runs import contiguous_runs
from stateful_hf.kernels.torch_backend import dense_reference, torch_paged_attention

KINDS = ("empty", "decode", "append", "scattered", "single", "dropped_prefix")


@st.composite
def ragged_case(draw, block_sizes=(16, 32, 64), head_dims=(64, 80), max_len=70):
    """A random ragged batch over a strided pool view: (query, key_cache, value_cache, batch, window).

    Sub-request kinds: empty context; decode row (q = 1); appended prompt (last m positions);
    scattered positions (random subset, random order); single-token context; and a dropped-prefix
    recompute (positions 0..p-1, kv_len p) next to its session's new prompt (same block table row).
    Pool blocks are handed out in random order; unused slots hold NaN so stray reads show."""
    bs = draw(st.sampled_from(block_sizes))
    d = draw(st.sampled_from(head_dims))
    hkv = draw(st.sampled_from((1, 2)))
    group = draw(st.sampled_from((1, 2)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    window = draw(st.one_of(st.none(), st.integers(1, 24)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    subs = []                                 # (kv_len, positions, table key)
    for n_session, kind in enumerate(kinds):
        n = {"empty": 0, "single": 1}.get(kind, draw(st.integers(1, max_len)))
        if kind == "decode":
            subs.append((n, [n - 1], n_session))
        elif kind == "append":
            m = draw(st.integers(1, n))
            subs.append((n, list(range(n - m, n)), n_session))
        elif kind == "scattered":
            pos = torch.randperm(n, generator=g)[: draw(st.integers(1, min(n, 20)))].tolist()
            subs.append((n, pos, n_session))
        elif kind == "single":
            subs.append((1, [0], n_session))
        elif kind == "empty":
            subs.append((0, [], n_session))
        else:
            n = max(n, 2)
            p = draw(st.integers(1, n - 1))
            m = draw(st.integers(1, n - p))
            subs.append((p, list(range(p)), n_session))
            subs.append((n, list(range(n - m, n)), n_session))
    sessions = {}
    for kv, _, key in subs:
        sessions[key] = max(sessions.get(key, 0), -(-kv // bs))
    width = max(max(sessions.values()), 1)
    num_blocks = sum(sessions.values()) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = {}
    for key, need in sessions.items():
        tables[key] = [order.pop() for _ in range(need)] + [10**6] * (width - need)   # junk past kv_len
    pool = torch.full((2, num_blocks, 2, bs, hkv, d), float("nan"))
    for kv, _, key in subs:
        for j in range(kv):
            if pool[1, tables[key][j // bs], 0, j % bs].isnan().any():
                pool[1, tables[key][j // bs], :, j % bs] = torch.randn(2, hkv, d, generator=g)
    cu_q = [0]
    for _, pos, _ in subs:
        cu_q.append(cu_q[-1] + len(pos))
    batch = PagedBatch(
        cu_q=torch.tensor(cu_q), q_pos=torch.tensor([p for _, pos, _ in subs for p in pos], dtype=torch.long),
        kv_len=torch.tensor([kv for kv, _, _ in subs]),
        block_table=torch.tensor([tables[key] for _, _, key in subs]),
    )
    query = torch.randn(cu_q[-1], hkv * group, d, generator=g)
    return query, pool[1, :, 0], pool[1, :, 1], batch, window


def assert_close_to_reference(outs, query, key_cache, value_cache, batch, window, atol=1e-5):
    """Every tensor in `outs` (one or a list) equals the float64 dense reference within atol."""
    ref = dense_reference(query.double(), key_cache.double(), value_cache.double(), batch,
                          query.shape[-1] ** -0.5, window)
    for out in outs if isinstance(outs, list) else [outs]:
        assert out.shape == query.shape and out.dtype == query.dtype
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64, 80, 96), max_len=48))
def test_torch_paths_match_dense_reference(case):
    query, kc, vc, batch, window = case
    assert not kc.is_contiguous()
    batched = paged_attention(query, kc, vc, batch, backend="torch", window=window)
    # the per-sub-request reference loop reads only keys < kv_len, so the NaN padding cannot reach it
    loop = torch_paged_attention(query, kc, vc, batch, query.shape[-1] ** -0.5, window)
    assert_close_to_reference([batched, loop], query, kc, vc, batch, window)


def bottom_right_causal(query, key_cache, value_cache, batch, scale, window):
    """What FlashInfer / flash-attn compute from the runs metadata: per run, keys 0..kv_len'-1 of its
    block table row and a causal mask aligned to the bottom right (row r at kv_len' - q_len + r)."""
    runs = contiguous_runs(batch)
    bs = key_cache.shape[1]
    out = torch.zeros_like(query)
    for r, (a, b) in enumerate(zip(runs.cu_q, runs.cu_q[1:])):
        kv, q_len = runs.kv_len[r], b - a
        blocks = batch.block_table[runs.seq[r], : -(-kv // bs)]
        k, v = (c[blocks].flatten(0, 1)[:kv].transpose(0, 1) for c in (key_cache, value_cache))
        row_pos = torch.arange(kv - q_len, kv)[:, None]
        keys = torch.arange(kv)[None, :]
        mask = (keys <= row_pos) & (keys >= row_pos - (window - 1) if window else True)
        out[a:b] = F.scaled_dot_product_attention(query[a:b].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True).transpose(0, 1)
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ragged_case(head_dims=(64,), max_len=40))
def test_runs_trick_reproduces_absolute_positions(case):
    query, kc, vc, batch, window = case
    out = bottom_right_causal(query, kc, vc, batch, query.shape[-1] ** -0.5, window)
    assert_close_to_reference(out, query, kc, vc, batch, window)


def test_runs_split_where_positions_jump():
    batch = PagedBatch(cu_q=torch.tensor([0, 5, 5, 6]), q_pos=torch.tensor([3, 4, 9, 0, 1, 7]),
                       kv_len=torch.tensor([10, 0, 8]), block_table=torch.zeros(3, 1, dtype=torch.long))
    runs = contiguous_runs(batch)
    assert runs.cu_q == [0, 2, 3, 5, 6] and runs.seq == [0, 0, 0, 2] and runs.kv_len == [5, 10, 2, 8]


def small_case(dtype=torch.float32, d=64, bs=16, hq=4, hkv=2):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 8, 2, bs, hkv, d, generator=g).to(dtype)
    batch = PagedBatch(cu_q=torch.tensor([0, 3, 4]), q_pos=torch.tensor([17, 18, 19, 5]),
                       kv_len=torch.tensor([20, 6]), block_table=torch.tensor([[5, 2], [7, 0]]))
    return torch.randn(4, hq, d, generator=g).to(dtype), pool[0, :, 0], pool[0, :, 1], batch


def test_plan_is_reused_across_layers_and_checked():
    query, kc, vc, batch = small_case()
    plan = kernels.plan(batch, block_size=16, backend="auto")
    assert plan.backend == "torch"
    first = paged_attention(query, kc, vc, batch, plan=plan)
    assert torch.equal(first, paged_attention(query, kc, vc, batch, plan=plan))
    assert torch.equal(first, paged_attention(query, kc, vc, batch))          # plan cached on the batch
    assert_close_to_reference(first, query, kc, vc, batch, None)
    other = PagedBatch(batch.cu_q, batch.q_pos, batch.kv_len, batch.block_table)
    with pytest.raises(ValueError, match="another batch"):
        paged_attention(query, kc, vc, other, plan=plan)


def test_invalid_metadata_raises_clear_errors():
    query, kc, vc, batch = small_case()
    bad_block = PagedBatch(batch.cu_q, batch.q_pos, batch.kv_len, torch.tensor([[5, 8], [7, 0]]))
    with pytest.raises(ValueError, match="block ids"):
        paged_attention(query, kc, vc, bad_block)
    negative = PagedBatch(batch.cu_q, batch.q_pos, batch.kv_len, torch.tensor([[5, -1], [7, 0]]))
    with pytest.raises(ValueError, match="block ids"):
        paged_attention(query, kc, vc, negative)
    too_long = PagedBatch(batch.cu_q, batch.q_pos, torch.tensor([33, 6]), batch.block_table)
    with pytest.raises(ValueError, match="kv_len 33"):
        paged_attention(query, kc, vc, too_long)
    past_context = PagedBatch(batch.cu_q, torch.tensor([17, 18, 20, 5]), batch.kv_len, batch.block_table)
    with pytest.raises(ValueError, match="outside its context"):
        paged_attention(query, kc, vc, past_context)
    with pytest.raises(TypeError, match="dtypes differ"):
        paged_attention(query.half(), kc, vc, batch)
    with pytest.raises(TypeError, match="dtypes differ"):
        paged_attention(query, kc, vc.double(), batch)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_attention(query[:, :3], kc, vc, batch)
    with pytest.raises(ValueError, match="head dims must match"):
        paged_attention(query[..., :32], kc, vc, batch)
    with pytest.raises(ValueError, match="rows"):
        paged_attention(query[:3], kc, vc, batch)
    with pytest.raises(ValueError, match="window"):
        paged_attention(query, kc, vc, batch, window=0)
    with pytest.raises(ValueError, match="unknown paged attention backend"):
        paged_attention(query, kc, vc, batch, backend="cuda-magic")


def test_backend_resolution_on_cpu(monkeypatch):
    assert kernels.resolve_backend("auto", "cpu") == "torch"
    assert kernels.resolve_backend("torch", "cpu") == "torch"
    assert kernels.available_backends("cpu")[-1] == "torch"
    with pytest.raises(ValueError, match="unknown"):
        kernels.resolve_backend("sdpa", "cpu")
    for name in ("flashinfer", "flash_attn"):
        with pytest.raises(RuntimeError, match="unavailable"):
            kernels.resolve_backend(name, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="triton backend unavailable"):
        kernels.resolve_backend("triton", "cpu")


def _gpu_case(dtype, bs):
    """A fixed mixed batch (decode, append, scattered, dropped prefix + new prompt) on CUDA."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 40, 2, bs, 2, 128, generator=g).to(dtype).cuda()
    kv = [300, 1, 97, 40, 200]
    pos = [[299], [0], [3, 50, 4, 5, 90], list(range(40)), list(range(150, 200))]
    cu = [0]
    for p in pos:
        cu.append(cu[-1] + len(p))
    width = -(-300 // bs)
    perm = torch.randperm(pool.shape[1], generator=g)
    table = torch.stack([perm[(i * 3) % 7: (i * 3) % 7 + width] for i in range(5)])
    table[4] = table[3]                       # the dropped prefix and the new prompt share a session's blocks
    batch = PagedBatch(torch.tensor(cu), torch.tensor(sum(pos, [])), torch.tensor(kv), table).to("cuda")
    query = torch.randn(cu[-1], 8, 128, generator=g).to(dtype).cuda()
    return query, pool[1, :, 0], pool[1, :, 1], batch


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 33])
def test_gpu_backends_match_dense_reference(backend, dtype, window):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip({"flashinfer": "flashinfer", "flash_attn": "flash_attn"}[backend])
    for bs in ((16, 256) if backend == "flash_attn" else (16, 32)):
        query, kc, vc, batch = _gpu_case(dtype, bs)
        plan = kernels.plan(batch, bs, backend=backend, dtype=dtype)
        out = paged_attention(query, kc, vc, batch, window=window, plan=plan)
        ref = dense_reference(query.cpu().double(), kc.cpu().double(), vc.cpu().double(), batch.to("cpu"),
                              128 ** -0.5, window)
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=0)
