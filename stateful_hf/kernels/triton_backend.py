"""Triton paged attention: fused online softmax over the block table, no gathered copy of the context.

One program per (query tile of one sub-request, query head). A tile is up to BLOCK_M consecutive
packed rows of one sub-request; it walks that sub-request's keys from the first any of its rows can see
to the last in BLOCK_N steps (BLOCK_N divides the pool's block size PAGE, so a step never straddles two
blocks; it is smaller than PAGE where a K+V tile would not fit shared memory), masking each (row, key) by
absolute position:
    key j visible to row t  <=>  j <= q_pos[t]  and  j < kv_len[i]  and  j > q_pos[t] - window.
With a softcap c, the scaled logits s become c * tanh(s / c) before masking (Gemma 2).
Fixed-split mode (`split`): BLOCK_N is `split` whatever the dtype or pool block size. A row's result
never depends on the other rows of its tile (their extra keys are masked to exact zeros, an MMA element
sums over its own row), so with the steps fixed it is bitwise the same alone, batched, chunked and over
any pool whose block size `split` divides: the batch-invariant attention on CUDA, as the CPU kernel's
split is there (tests/test_kernels_triton.py, under the interpreter).
Caches are read through their strides, so `pool[l, :, 0]` views of a
[layers, blocks, 2, block_size, kv_heads, head_dim] pool work without a copy.

triton is imported only when this backend is first used. On a machine without a GPU it runs under
the interpreter: set TRITON_INTERPRET=1 before the first call (the kernel is built on first use and
triton reads the variable when the kernel is decorated).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .batch import PagedBatch
from .runs import package_imports

BLOCK_M = 16        # query rows per program (tl.dot needs >= 16)
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_TILE_BYTES = 64 * 1024   # one step's K + V tiles at most: the cubin then fits sm_80's 163 KiB of shared memory
_KERNEL = None      # built on first use: the jit-decorated kernel
tl = None           # triton.language once _build() ran; the kernels look it up as a module global


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str) -> bool:
    """True when triton imports (a failure of any kind counts as absent) and can run on `device`
    (CUDA, or any device interpreted)."""
    return package_imports("triton") and (torch.device(device).type == "cuda" or interpreted())


def _max_fn(a, b):
    return tl.maximum(a, b)  # noqa: F821 - `tl` is bound when _build() decorates these


def _min_fn(a, b):
    return tl.minimum(a, b)  # noqa: F821


def _add_fn(a, b):
    return a + b


def _build():
    global tl
    import triton
    import triton.language as tl

    # Reductions go through tl.reduce with combine functions decorated now (module globals, where the
    # jit looks names up), not tl.max/tl.min/tl.sum: those are @jit functions of triton's standard
    # library, decorated when triton is first imported. If that import happened before TRITON_INTERPRET
    # was set (transformers imports torch._dynamo, which imports triton), they are compiled-mode
    # functions the interpreter refuses to call; functions decorated here follow the current setting.
    global _max, _min, _add
    _max, _min, _add = (triton.jit(f) for f in (_max_fn, _min_fn, _add_fn))

    @triton.jit
    def paged_attention_kernel(
        Q, K, V, Out,                     # Q/O [T, Hq, D]; K/V [num_blocks, block_size, Hkv, D] (strided)
        tile_seq, tile_row,               # [num_tiles] sub-request of the tile, its first packed row
        cu_q, q_pos, kv_len, block_table,  # the PagedBatch tensors
        scale, window, softcap,           # window <= 0: no sliding window; softcap <= 0: no logit softcap
        sq_t, sq_h, sq_d, so_t, so_h, so_d,
        sk_b, sk_s, sk_h, sk_d, sv_b, sv_s, sv_h, sv_d,
        sbt_s, sbt_m,
        GROUP: tl.constexpr,              # Hq // Hkv
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,   # BLOCK_D = next power of two >= HEAD_DIM
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,    # BLOCK_N: keys per step, a divisor of PAGE
        PAGE: tl.constexpr,               # the pool's block_size
        PRECISION: tl.constexpr,          # "ieee" for fp32 (no tf32), "tf32" otherwise (ignored by fp16/bf16)
        UPCAST: tl.constexpr,             # compute the dots in fp32 (interpreted bf16, see below)
    ):
        # Index tensors may be int32 or int64 (PagedBatch takes both): every index value is int32 from here
        # on, so branches that redefine one (lo below) keep one type; block ids widen to int64 for offsets.
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(tile_seq + tile).to(tl.int32)
        row0 = tl.load(tile_row + tile).to(tl.int32)
        row_end = tl.load(cu_q + seq + 1).to(tl.int32)
        n_kv = tl.load(kv_len + seq).to(tl.int32)

        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        pos = tl.load(q_pos + rows, mask=row_ok, other=-1).to(tl.int32)  # [BLOCK_M]

        q = tl.load(Q + rows[:, None] * sq_t + head * sq_h + offs_d[None, :] * sq_d,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)    # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)

        # keys any row of the tile can see: [lo, hi)
        hi = tl.minimum(n_kv, tl.reduce(pos, 0, _max) + 1)
        lo = 0
        if window > 0:
            lo = tl.maximum(tl.reduce(tl.where(row_ok, pos, 2147483647), 0, _min) - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)   # finite floor: fully masked rows give p = 0, not nan
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)   # tl.zeros is a stdlib @jit: see _build
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            block = tl.load(block_table + seq * sbt_s + (start // PAGE) * sbt_m).to(tl.int64)
            keys = start + offs_n                                         # absolute key positions [BLOCK_N]
            slots = start % PAGE + offs_n                                 # their slots in `block`
            k_ok = keys < hi
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K + block * sk_b + slots[:, None] * sk_s + kv_head * sk_h + offs_d[None, :] * sk_d,
                        mask=kv_mask, other=0.0)                          # [BLOCK_N, BLOCK_D]
            v = tl.load(V + block * sv_b + slots[:, None] * sv_s + kv_head * sv_h + offs_d[None, :] * sv_d,
                        mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N] fp32
            if softcap > 0:   # c * tanh(s / c), tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1, no nan
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            visible = (keys[None, :] <= pos[:, None]) & k_ok[None, :]
            if window > 0:
                visible = visible & (keys[None, :] > pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _add)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + rows[:, None] * so_t + head * so_h + offs_d[None, :] * so_d,
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return paged_attention_kernel


def query_tiles(batch: PagedBatch, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_tiles] sub-request, [num_tiles] first packed row) of every BLOCK_M-row query tile."""
    cu_q, _ = batch.host
    seqs, rows = [], []
    for i, (a, b) in enumerate(zip(cu_q, cu_q[1:])):
        for r in range(a, b, block_m):
            seqs.append(i)
            rows.append(r)
    device = batch.cu_q.device
    return (torch.tensor(seqs, dtype=torch.int32, device=device),
            torch.tensor(rows, dtype=torch.int32, device=device))


def triton_paged_attention(
    query: torch.Tensor,        # [T, Hq, D]
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D], any strides
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], any strides
    batch: PagedBatch,
    scale: float,
    window: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,   # query_tiles(batch), precomputed per step
    softcap: float | None = None,   # logits become softcap * tanh(logits / softcap) (Gemma 2)
    split: int | None = None,       # keys per online-softmax step, fixed (batch invariance); None: by tile size
) -> torch.Tensor:              # [T, Hq, D]
    check_supported(query.shape[2], key_cache.shape[1], query.dtype)
    check_split(split, query.shape[2], key_cache.shape[1], query.dtype)
    t = query.shape[0]
    out = torch.empty_like(query)
    seqs, rows = query_tiles(batch) if tiles is None else tiles
    if t == 0 or seqs.numel() == 0:
        return out
    launch = kernel_launch(query, key_cache, value_cache, out, batch, scale, window, softcap, (seqs, rows),
                           interpreted(), split)
    kernel()[launch.grid](*launch.args, **launch.constexprs)
    return out


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One launch of `paged_attention_kernel`: what a call passes and what a compile check specialises."""

    grid: tuple[int, int]               # (query tiles, query heads)
    args: tuple[Any, ...]               # the kernel's runtime parameters, in its order
    constexprs: dict[str, Any]          # its tl.constexpr parameters by name


def supports(dtype: torch.dtype | None = None, head_dim: int | None = None,
             block_size: int | None = None) -> str | None:
    """None when the kernel compiles for (dtype, head_dim, pool block size), else why not; None
    arguments are not checked (the backend selection's and `check_supported`'s one rule)."""
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype} not in {DTYPES}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} not in {HEAD_DIMS}"
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        return f"block_size {block_size} is not a power of two >= 16"
    return None


def block_n(head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Keys per step by default: the pool's block size, less where a K + V tile would not fit KV_TILE_BYTES."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return min(block_size, KV_TILE_BYTES // (2 * block_d * dtype.itemsize))


def check_split(split: int | None, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless `split` (None: the default) can be the kernel's keys per step: a power of two
    >= 16 dividing the block size whose K + V tile fits, so the steps, and with them the online softmax's
    arithmetic, are the same whatever the batch, dtype tiling or pool."""
    if split is None:
        return
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    fits = 2 * split * block_d * dtype.itemsize <= KV_TILE_BYTES
    if isinstance(split, bool) or not isinstance(split, int) or split < 16 or split & (split - 1) \
            or block_size % split or not fits:
        raise ValueError(f"triton paged attention: split {split!r} must be a power of two >= 16 dividing the block "
                         f"size {block_size}, at most {block_n(head_dim, 1 << 20, dtype)} keys for head_dim "
                         f"{head_dim} in {dtype}")


def check_supported(head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Raise ValueError unless the kernel compiles for this head_dim, pool block size and dtype."""
    reason = supports(dtype, head_dim, block_size)
    if reason is not None:
        raise ValueError(f"triton paged attention: {reason}")


def kernel_launch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                  batch: PagedBatch, scale: float, window: int | None, softcap: float | None,
                  tiles: tuple[torch.Tensor, torch.Tensor], interpret: bool, split: int | None = None) -> KernelLaunch:
    """The kernel's arguments for these tensors: the one place that builds them (launches and the compile
    test in tests/test_triton_compile.py both use it, so a new argument or index dtype cannot be missed).
    The caller has checked the shapes (`check_supported`) and `split` (`check_split`; None: `block_n`)."""
    _, hq, d = query.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    seqs, rows = tiles
    # triton 3.9's interpreter returns garbage from tl.dot on bf16 operands (a 16x16 bf16 a @ a is off by
    # 1e10), so interpreted bf16 runs its dots in fp32; compiled bf16 uses the tensor-core bf16 dot.
    upcast = query.dtype == torch.bfloat16 and interpret
    args = (
        query, key_cache, value_cache, out,
        seqs, rows,
        batch.cu_q, batch.q_pos, batch.kv_len, batch.block_table,
        float(scale), int(window or 0), float(softcap or 0.0),
        *query.stride(), *out.stride(),
        *key_cache.stride(), *value_cache.stride(),
        *batch.block_table.stride(),
    )
    block_d = max(16, 1 << (d - 1).bit_length())
    step = split or block_n(d, block_size, query.dtype)                  # >= 16: fp32 x 256 -> 32
    constexprs = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d,
                      BLOCK_M=BLOCK_M, BLOCK_N=step, PAGE=block_size,
                      PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)
    return KernelLaunch(grid=(seqs.numel(), hq), args=args, constexprs=constexprs)


def kernel():
    """The jit-decorated `paged_attention_kernel`, built on first use (under the TRITON_INTERPRET then set)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    return _KERNEL
