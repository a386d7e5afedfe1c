"""Batch-invariant kernels on the CPU: while `batch_invariant(split)` is active, a row's result does not
depend on how many other rows its call has, how a prompt is chunked, or the thread count.

Entering the context registers, with `torch.library` on the CPU dispatch key, kernels for the aten ops
that make transformers models batch-dependent; leaving the last one restores the stock kernels:

  - `mm`, `addmm` (every linear layer): a row's bits are those of fixed tiles of ROWS rows (the last one
    padded with zeros), each tile one call of the same shape, so a row's sums never depend on M and the
    BLAS picks the same blocking whatever the batch (tests: also at 1 and 2 threads). A model parameter
    the CPU multiplies through MKL's packed sgemm (float32; bf16 without bf16 units, cast up:
    `LinearKernel.MKL_UPCAST`) goes through that packed copy, made once and kept (`_PACKED`): float32 sums,
    the bias added, rounded once to the model's dtype. Where one call on all M rows gives the tiles'
    float32 bits, that call is made instead (`_ONE_CALL`: checked once per shape, layout and team size on a
    random probe, against the tiles; 5-8x faster at 128-256 rows); MKL's packed sgemm does so at
    SmolLM2's shapes here, a kernel that does not keeps the tiles. Never on bf16 sums: rounding to 8 bits
    hides a different order on most data, so a check proves nothing there (a test showed it);
  - `scaled_dot_product_attention`: the CPU kernel of `kernels/cpu_backend.py` over the contiguous K/V cut
    into splits of `split` keys, the same arithmetic the engine's paged steps run over the pool's blocks
    (float32 scores and online softmax, splits in ascending order), so stateless `generate` under the
    context is the oracle the stateful paths equal bitwise.

Row-wise reductions (RMSNorm/LayerNorm, softmax, argmax) and elementwise ops are already per row on
the CPU. The dispatcher's table is process-wide while a context is active, so the kernels look at the
calling thread: a thread outside every context gets the stock kernels (`mm.out`, `addmm.out`, SDPA's
math kernel: the same values to rounding), so an engine stepping invariantly on one thread changes
nothing for another thread's `generate`. docs/cpu.md#batch-invariance.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .batch import PagedBatch
from .cpu_backend import CpuPlan, available, unavailable_reason
from .cpu_features import CpuFeatures
from .linear import LinearKernel, choose, pack, sums, weight_key
from .quantization import plain

ROWS = 16                  # rows of every GEMM call under the context
PACK_ROWS = 256            # MKL's packing hint: the engine's default step rows (its own packed copies' hint)

_lock = threading.Lock()
_state: dict = {"depth": 0, "lib": None, "split": None}     # the process's contexts (the registration)
_inside = threading.local()                                 # .depth: the calling thread's open contexts


@contextmanager
def batch_invariant(split: int = 32) -> Iterator[None]:
    """Batch-invariant mm, addmm and SDPA on the CPU inside the block (re-entrant with the same split).
    `split`: keys per step of the attention's online softmax; a store made with `batch_invariant=True`
    uses its chunk size, which must equal it."""
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"split must be an int >= 1, got {split!r}")
    if not available("cpu"):
        raise RuntimeError(f"batch_invariant needs the CPU attention kernel: {unavailable_reason()}")
    with _lock:
        if _state["depth"] and _state["split"] != split:
            raise ValueError(f"batch_invariant(split={split}) inside batch_invariant(split={_state['split']})")
        if not _state["depth"]:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():          # "overriding a previously registered kernel": the point
                warnings.simplefilter("ignore")
                lib.impl("mm", _mm, "CPU")
                lib.impl("addmm", _addmm, "CPU")
                lib.impl("scaled_dot_product_attention", _sdpa, "CPU")
            _state.update(lib=lib, split=split)
        _state["depth"] += 1
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        with _lock:
            _state["depth"] -= 1
            if not _state["depth"]:
                _state["lib"]._destroy()
                _state.update(lib=None, split=None)


def active_split() -> int | None:
    """The split of the active context, None outside one."""
    return _state["split"]


def _outside() -> bool:
    """Whether the calling thread is in no context (its GEMMs and attention take the stock kernels)."""
    return not getattr(_inside, "depth", 0)


# id(parameter) -> (weakref to it, its weight_key, its MKL-packed [N, K] weight): a copy is used only while
# the parameter is alive, unmoved and unchanged in place; otherwise it is made again; it goes with the parameter.
_PACKED: dict[int, tuple] = {}
_MKL = (LinearKernel.MKL_PACKED, LinearKernel.MKL_UPCAST)


def _packed_weight(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight [N, K], its MKL-packed float32 copy) when `b` [K, N] is the transpose of a model parameter
    (F.linear's weight.t()) whose dtype the CPU multiplies through MKL's packed sgemm (float32; bf16
    without bf16 units: `LinearKernel.MKL_UPCAST`); else None (the plain tiles)."""
    w = b._base
    if not isinstance(w, torch.nn.Parameter) or w.dim() != 2 or b.stride() != (1, w.shape[1]):
        return None
    key, have = weight_key(w), _PACKED.get(id(w))
    if have is not None and have[0]() is w and have[1] == key:
        return w, have[2]
    if not w.is_contiguous() or choose(w.dtype, w.device, CpuFeatures.detect()) not in _MKL:
        return None
    wid = id(w)
    gone = weakref.ref(w, lambda _: _PACKED.pop(wid, None))     # a dead parameter's copy is freed with it
    have = _PACKED[wid] = (gone, key, pack(w, LinearKernel.MKL_PACKED, PACK_ROWS))
    return w, have[2]


def pack_weights(model: torch.nn.Module) -> None:
    """Make the packed copies of `model`'s linear weights now, on the calling thread (a store made with
    batch_invariant=True does, at creation): copies first made mid-run on an engine's loop thread
    multiplied x1.7 slower here (MKL's allocation; docs/cpu.md#batch-invariance)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and plain(m.weight):     # a quantized weight has its own kernel
            _packed_weight(m.weight.t())


# (op, packed, dtype, b's shape and strides, M, a's strides and 64-byte offset, team size) -> whether
# one call on all M rows gives the tiles' bits: checked once on random float32 rows of a's layout (GEMM
# kernels pick their blocking by shape, layout and threads, never by values; a different order changes
# some of >= 32 float32 sums of random terms), then trusted; False keeps the tiles.
_ONE_CALL: dict[tuple, bool] = {}
CHECKED_OUTPUTS = 32       # fewest outputs a float32 check needs to be conclusive


def _checkable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a stock call's bits can be checked against the tiles: float32, >= CHECKED_OUTPUTS out."""
    return a.dtype == b.dtype == torch.float32 and a.shape[0] * b.shape[1] >= CHECKED_OUTPUTS


def _rows(a: torch.Tensor, key: tuple, one, tiled, checkable: bool) -> torch.Tensor:
    """The tiles' result `tiled(a)`, through `one(a)` once it gave the same bits on a probe of a's layout
    for `key` (only where `checkable`)."""
    if not checkable:
        return tiled(a)
    key += (torch.get_num_threads(),)
    ok = _ONE_CALL.get(key)
    if ok is None:
        probe = _probe(a)
        ok = _ONE_CALL[key] = torch.equal(one(probe), tiled(probe))
    return one(a) if ok else tiled(a)


def _probe(a: torch.Tensor) -> torch.Tensor:
    """Random float32 values with a's shape, strides and offset from a 64-byte boundary."""
    offset = a.data_ptr() % 64 // a.element_size()
    size = offset + 1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride(), strict=True))
    values = torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=a.dtype)
    return values.as_strided(a.shape, a.stride(), offset)


def _shape_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (a.dtype, tuple(b.shape), b.stride(), a.shape[0], a.stride(), a.data_ptr() % 64)


def _tiles(m: int) -> range:
    return range(0, m + (-m) % ROWS, ROWS)


def _padded(a: torch.Tensor) -> torch.Tensor:
    pad = (-a.shape[0]) % ROWS
    return torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a


def _mm(a: torch.Tensor, b: torch.Tensor, packed: tuple | None = None,
        bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) with the bits of tiles of ROWS rows (one shape for every tile):
    through `packed` (weight, its packed copy: `_packed_weight(b)`, looked up when not given; float32 sums,
    the bias added to them, rounded once to a's dtype), else mm.out (the stock kernel); one call on all
    rows where that was seen to give the same bits (`_rows`)."""
    if _outside():
        return torch.mm(a, b, out=a.new_empty(a.shape[0], b.shape[1]))
    packed = packed or _packed_weight(b)
    if packed is None:
        return _rows(a, ("mm", False, *_shape_key(a, b)), lambda x: torch.mm(x, b, out=x.new_empty(len(x), b.shape[1])),
                     lambda x: _tiled_mm(x, b, None), _checkable(a, b))
    w, copy = packed
    out = _rows(a, ("mm", True, *_shape_key(a, b)), lambda x: sums(x, copy, w, None),
                lambda x: _tiled_mm(x, b, packed), a.shape[0] * b.shape[1] >= CHECKED_OUTPUTS)
    return (out if bias is None else out + bias.float()).to(a.dtype)


def _tiled_mm(a: torch.Tensor, b: torch.Tensor, packed: tuple | None) -> torch.Tensor:
    """The tiles: float32 sums through `packed`, else mm.out in a's dtype."""
    m = a.shape[0]
    ap = _padded(a)
    out = ap.new_empty(ap.shape[0], b.shape[1], dtype=a.dtype if packed is None else torch.float32)
    for i in _tiles(m):
        if packed is not None:
            out[i: i + ROWS] = sums(ap[i: i + ROWS], packed[1], packed[0], None)
        else:
            torch.mm(ap[i: i + ROWS], b, out=out[i: i + ROWS])
    return out[:m]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """beta * bias + alpha * (a @ b) in tiles of ROWS rows; bias [N], [1, N] or [M, N]."""
    m = a.shape[0]
    if _outside():
        return torch.addmm(bias, a, b, beta=beta, alpha=alpha, out=a.new_empty(m, b.shape[1]))
    packed = _packed_weight(b) if beta == 1 and alpha == 1 and bias.dim() == 1 else None
    if packed is not None:
        return _mm(a, b, packed, bias)                 # F.linear's bias: added to the float32 sums
    full = bias.expand(m, b.shape[1])

    def tiled(x: torch.Tensor) -> torch.Tensor:
        xp, bp = _padded(x), _padded(full)
        out = x.new_empty(xp.shape[0], b.shape[1])
        for i in _tiles(m):
            torch.addmm(bp[i: i + ROWS], xp[i: i + ROWS], b, beta=beta, alpha=alpha, out=out[i: i + ROWS])
        return out[:m]

    def one(x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(full, x, b, beta=beta, alpha=alpha, out=x.new_empty(m, b.shape[1]))

    key = ("addmm", bias.dtype, beta, alpha, tuple(bias.shape), bias.stride(), *_shape_key(a, b))
    return _rows(a, key, one, tiled, _checkable(a, b) and bias.dtype == torch.float32)


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """query [B, Hq, Lq, D], key/value [B, Hkv, L, D] -> [B, Hq, Lq, D] through the CPU kernel. Each
    query row sees a prefix of the keys: `is_causal` (top-left, as SDPA aligns it), no mask (every key),
    or a mask whose rows are prefixes (transformers' causal masks); a mask with holes (padding) raises."""
    if _outside():
        return _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if dropout_p:
        raise NotImplementedError("batch_invariant: attention dropout is not supported")
    b, hq, lq, d = query.shape
    length = key.shape[2]
    split = _state["split"]
    if attn_mask is None:
        pos = torch.arange(lq) if is_causal else torch.full((lq,), length - 1)
        last = [pos] * b
    else:
        visible = attn_mask if attn_mask.dtype == torch.bool else attn_mask == 0
        visible = visible.expand(b, 1, lq, length)[:, 0]
        if is_causal:
            visible = visible & torch.ones(lq, length, dtype=torch.bool).tril()
        seen = visible.sum(-1)                                   # [B, Lq] keys each row sees
        if not torch.equal(visible, torch.arange(length) < seen[..., None]):
            raise NotImplementedError("batch_invariant: attention masks whose rows are not prefixes of the keys "
                                      "(padding) are not supported")
        last = list(seen - 1)
    scale = d ** -0.5 if scale is None else scale
    out = query.new_empty(b, hq, lq, d)
    blocks = -(-length // split)
    for i in range(b):
        kv = []
        for t in (key[i], value[i]):                            # [Hkv, L, D] -> [blocks, split, Hkv, D]
            rows = t.new_zeros(blocks * split, t.shape[0], d)
            rows[:length] = t.transpose(0, 1)
            kv.append(rows.view(blocks, split, t.shape[0], d))
        batch = PagedBatch(cu_q=torch.tensor([0, lq]), q_pos=last[i].clamp(min=-1).long(),
                           kv_len=torch.tensor([length]), block_table=torch.arange(blocks)[None])
        out[i] = CpuPlan(batch, split).run(query[i].transpose(0, 1), kv[0], kv[1], scale).transpose(0, 1)
    return out


def _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA's math, in float32 (a thread in no context: any mask, dropout, GQA): [B, Hq, Lq, D]."""
    if enable_gqa:
        key, value = (t.repeat_interleave(query.shape[-3] // t.shape[-3], -3) for t in (key, value))
    q, k, v = query.float(), key.float(), value.float()
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.float()
    weights = torch.nn.functional.dropout(scores.softmax(-1), dropout_p) if dropout_p else scores.softmax(-1)
    return (weights @ v).to(query.dtype)
