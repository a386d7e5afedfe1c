"""Paged attention kernels: the torch paths, the runs trick of the GPU backends, metadata errors, backend
choice (auto's fallback, forced backends refused at store creation, optional packages that fail to
import), and (when CUDA and the packages are present) FlashInfer, flash-attn and Triton, all against the
naive float64 `dense_reference`. Batch helpers here are shared with test_kernels_triton.py."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stateful_hf
from stateful_hf import kernels
from stateful_hf.cache import CostProfile, KVSpec, KVStore
from stateful_hf.kernels import PagedBatch, flash_attn_backend, flashinfer_backend, paged_attention, runs
from stateful_hf.kernels.runs import contiguous_runs
from stateful_hf.kernels.torch_backend import dense_reference, torch_paged_attention
from stateful_hf.testing import tiny_llama

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


@pytest.fixture
def fake_gpu(monkeypatch):
    """Every GPU backend's package and device present (only the selection runs: nothing is launched)."""
    for mod in (flashinfer_backend, flash_attn_backend, kernels.triton_backend):
        monkeypatch.setattr(mod, "available", lambda device: True)


def test_auto_falls_back_past_backends_that_cannot_serve_with_a_logged_reason(fake_gpu, caplog):
    fp16, fp32 = torch.float16, torch.float32
    cases = [   # (dtype, head_dim, block_size, features) -> backend auto picks
        ((fp16, 64, 32, {}), "flashinfer"),
        ((fp16, 80, 32, {}), "flash_attn"),                 # FlashInfer: 64/128/256 only
        ((fp32, 64, 32, {}), "triton"),                     # FlashInfer and FA2 compute in fp16/bf16 only
        ((fp32, 64, 24, {}), "torch"),                      # Triton: a power-of-two block size >= 16
        ((fp16, 16, 32, {}), "flash_attn"),                 # FA2: a multiple of 8 up to 256
        ((fp16, 12, 32, {}), "torch"),                      # no GPU backend takes head_dim 12
        ((fp16, 64, 32, {"layerwise_kv": True}), "torch"),  # LayerKV's overlays: torch only
        ((fp16, 64, 32, {"layout": "virtual"}), "torch"),   # the virtual layout attends densely
    ]
    for (dtype, d, bs, features), want in cases:
        assert kernels.select_backend("auto", "cuda", dtype, d, bs, **features).name == want, (dtype, d, bs, features)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stateful_hf.kernels.kernel_plan"):
        choice = kernels.select_backend("auto", "cuda", fp32, 16, 32)
    assert choice.name == "torch" and [line.split(":")[0] for line in choice.skipped] == [
        "flashinfer skipped", "flash_attn skipped", "triton skipped"]
    assert "triton skipped: head_dim 16 not in (64, 80" in choice.skipped[2]
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == list(choice.skipped)   # one line each
    assert kernels.select_backend("auto", "cpu", fp16, 64, 32).name == "torch"   # the CPU: torch (cpu by name)
    assert kernels.available_backends("cuda", fp16) == ["flashinfer", "flash_attn", "triton", "torch"]
    assert kernels.available_backends("cuda", fp32) == ["triton", "torch"]


def test_forced_backend_is_refused_at_store_creation_naming_what_it_supports(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    profile = CostProfile()
    d16 = tiny_llama()                                                         # head_dim 16
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    d64, d64_fp64, d64_bf16 = tiny_llama(**heads), tiny_llama(**heads).double(), tiny_llama(**heads).bfloat16()
    refused = [   # (model, store options, error, message)
        (d16, dict(attn_backend="triton"), ValueError, r"head_dim 16 not in \(64, 80, 96, 128, 256\)"),
        (d64, dict(attn_backend="triton", chunk_size=24), ValueError, "block_size 24 is not a power of two >= 16"),
        (d64, dict(attn_backend="flashinfer"), ValueError, r"dtype torch.float32 not in \(torch.float16"),
        (d64, dict(attn_backend="flash_attn"), ValueError, "dtype torch.float32 not in"),
        (d64_fp64, dict(attn_backend="triton"), ValueError, r"dtype torch.float64 not in \(torch.float32"),
        (d64, dict(attn_backend="triton", layerwise_kv=True, host_capacity=512), ValueError,
         "layerwise_kv needs attn_backend='torch'"),
        (d64, dict(attn_backend="triton", layout="virtual", max_context=256), ValueError, "layout='virtual'"),
        (d64, dict(attn_backend="triton"), RuntimeError, "triton backend unavailable on cpu"),   # no CUDA, compiled
    ]
    for model, options, error, message in refused:
        with pytest.raises(error, match=message):
            stateful_hf.SessionStore(model, 256, cost_profile=profile, **options)
    for name in ("flashinfer", "flash_attn"):          # served shape, missing package and device: as before
        with pytest.raises(RuntimeError, match=f"{name} backend unavailable on cpu"):
            stateful_hf.SessionStore(d64_bf16, 256, cost_profile=profile, attn_backend=name)
    with pytest.raises(ValueError, match="head_dim 16 not in"):   # the model-free store resolves it too
        KVStore(KVSpec(2, 2, 16, block_size=16), 256, attn_backend="triton")
    assert KVStore(KVSpec(2, 2, 16, block_size=16), 256, attn_backend="auto").attn_backend == "torch"
    store = stateful_hf.SessionStore(d64, 256, cost_profile=profile, layerwise_kv=True, host_capacity=512)
    assert store.attn_backend == "torch"                    # auto with LayerKV: never a backend it cannot use
    store.close()


class _FailingFinder:
    """A meta path finder under which importing `name` raises `error` (a half-installed package)."""

    def __init__(self, name: str, error: Exception):
        self.name, self.error = name, error

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise self.error
        return None


@pytest.mark.parametrize("error", [RuntimeError("CUDA runtime mismatch"), OSError("libcudart.so.13: cannot open"),
                                   AttributeError("module 'torch' has no attribute 'x'"),
                                   ImportError("undefined symbol: _ZN3c10")])
def test_optional_package_failing_to_import_counts_as_absent(error, monkeypatch, caplog):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder("flashinfer", error), *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for mod in (flash_attn_backend, kernels.triton_backend):      # present: auto goes on past flashinfer
        monkeypatch.setattr(mod, "available", lambda device: True)
    runs.log_import_failure.cache_clear()
    with caplog.at_level(logging.WARNING, logger="stateful_hf.kernels.runs"):
        assert not runs.cuda_package_available("cuda", "flashinfer")
        assert not runs.cuda_package_available("cuda", "flashinfer")
        choice = kernels.select_backend("auto", "cuda", torch.float16, 64, 32)
    assert choice.name == "flash_attn" and choice.skipped == ("flashinfer skipped: needs CUDA and flashinfer-python",)
    failures = [r.getMessage() for r in caplog.records if r.name == "stateful_hf.kernels.runs"]
    assert failures == [f"flashinfer fails to import ({type(error).__name__}: {error}); treated as absent"]   # once
    with pytest.raises(RuntimeError, match="flashinfer backend unavailable on cuda"):
        kernels.select_backend("flashinfer", "cuda", torch.float16, 64, 32)


def test_missing_optional_package_is_absent_silently(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "flashinfer", None)      # import raises ModuleNotFoundError for it
    with caplog.at_level(logging.WARNING, logger="stateful_hf.kernels.runs"):
        assert not runs.package_imports("flashinfer")
    assert not caplog.records


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
@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 33])
def test_gpu_backends_match_dense_reference(backend, dtype, window):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip(backend)
    for bs in ((16, 256) if backend == "flash_attn" else (16, 32)):
        query, kc, vc, batch = _gpu_case(dtype, bs)
        plan = kernels.plan(batch, bs, backend=backend, dtype=dtype)
        out = paged_attention(query, kc, vc, batch, window=window, plan=plan)
        ref = dense_reference(query.cpu().double(), kc.cpu().double(), vc.cpu().double(), batch.to("cpu"),
                              128 ** -0.5, window)
        torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=0)
