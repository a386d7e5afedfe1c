"""Backend choice and the per-step plan every layer of one engine step reuses.

    plan = kernels.plan(batch, block_size, backend="auto")      # once per step, after the batch is built
    out = kernels.paged_attention(q, k_cache, v_cache, batch, plan=plan)   # in every layer

A plan holds what a backend derives from the batch alone (groups and gather indices, query tiles,
FlashInfer's planned wrapper, run metadata), so layers do no host work and no host-device syncs.
No globals: the caller owns the plan and a KernelState it keeps across steps (one per store or
engine: FlashInfer's workspace and wrapper, made on first use and re-planned by each step's plan).

The one entry point: attention of packed ragged queries over a paged KV pool. Writing K/V into
the pool is the store's (`stateful_hf/cache/step.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..options import Layout
from . import cpu_backend, flash_attn_backend, flashinfer_backend, triton_backend
from .batch import Overlay, PagedBatch
from .torch_batched import TorchPlan

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer", "flash_attn")
PREFERENCE = ("flashinfer", "flash_attn", "triton", "torch")   # auto's order: fixed, not measured
# "cpu" (cpu_backend.py) is chosen by name here; a SessionStore's "auto" on the CPU then measures it against torch
# per run length (`step_backends.py`) and gives it the runs it wins. Batch invariance builds on it.
LAYOUTS = tuple(Layout)
# Each compiled backend module's supports(dtype, head_dim, block_size) -> None or why not, and
# available(device); the torch backend serves every device, dtype, head_dim and block size, and alone
# reads LayerKV's overlays.
_COMPILED = {"flashinfer": flashinfer_backend, "flash_attn": flash_attn_backend, "triton": triton_backend,
             "cpu": cpu_backend}
_NEEDS = {"flashinfer": "CUDA and flashinfer-python", "flash_attn": "CUDA (sm80+) and flash-attn",
          "triton": "the triton package and CUDA, or TRITON_INTERPRET=1 set before first use",
          "cpu": "the CPU and a C++ compiler (built once from stateful_hf/kernels/csrc)"}


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """`select_backend`'s answer: a concrete backend and, for "auto", one line per backend passed over
    in preference order ("triton skipped: head_dim 16 not in (64, 80, 96, 128, 256)")."""

    name: str
    skipped: tuple[str, ...] = ()


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None,
                   head_dim: int | None = None, block_size: int | None = None, *, layerwise_kv: bool = False,
                   layout: Layout | str = Layout.PAGED) -> BackendChoice:
    """The paged-attention backend for `name` serving a store on `device` with this dtype, head_dim,
    block size and features (None: not checked). "auto" walks PREFERENCE and passes over, logging
    one line each, any backend that cannot serve it (the GPU backends only on CUDA; the CPU gets torch here, and a
    SessionStore then measures the C++ kernel of cpu_backend.py against it per run length: step_backends.py).
    A backend forced by name raises: ValueError for an unknown name or one that cannot serve the dtype,
    head_dim, block size or features (naming what it supports), RuntimeError for a missing package or
    device. Features: `layerwise_kv` (LayerKV's host-resident layers are overlays only torch reads);
    layout "virtual" attends through kernels/dense.py, never a paged backend, so it names torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {name!r}; choose from {BACKENDS}")
    layout = layout if isinstance(layout, Layout) else Layout.of("layout", layout)
    if name != "auto":
        refusal = _refusal(name, device, dtype, head_dim, block_size, layerwise_kv, layout, forced=True)
        if refusal is not None:
            raise refusal
        return BackendChoice(name)
    skipped = []
    for candidate in PREFERENCE[:-1]:
        refusal = _refusal(candidate, device, dtype, head_dim, block_size, layerwise_kv, layout, forced=False)
        if refusal is None:
            return BackendChoice(candidate, tuple(skipped))
        skipped.append(f"{candidate} skipped: {refusal.args[0]}")
        logger.info("attn_backend='auto' on %s: %s", device, skipped[-1])
    return BackendChoice("torch", tuple(skipped))     # PREFERENCE's last: serves every store


def _refusal(name: str, device: torch.device | str, dtype: torch.dtype | None, head_dim: int | None,
             block_size: int | None, layerwise_kv: bool, layout: Layout, *, forced: bool) -> Exception | None:
    """Why `name` cannot serve this store (None: it can). Checked in order: (auto only) a CUDA device,
    then features, dtype, head_dim and block size (ValueError), then package and device (RuntimeError).
    A forced backend's message names the backend and what it supports; auto's is the bare reason."""
    if name == "torch":
        return None
    device_type = torch.device(device).type
    if not forced and name == "cpu" and device_type != "cpu":
        return RuntimeError("needs the CPU")
    if not forced and name != "cpu" and device_type != "cuda":
        return RuntimeError("needs CUDA" + (" (the CPU runs it interpreted only when forced)" if name == "triton"
                                            else ""))
    if layerwise_kv:
        why = "layerwise_kv needs attn_backend='torch' (only the torch backend reads LayerKV's host-resident " \
              "layers, its overlays)"
    elif layout is Layout.VIRTUAL:
        why = "layout='virtual' attends through kernels/dense.py, never a paged backend (use 'torch' or 'auto')"
    else:
        why = _COMPILED[name].supports(dtype, head_dim, block_size)
    if why is not None:
        return ValueError(f"attn_backend={name!r} unsupported here: {why}" if forced else why)
    if _COMPILED[name].available(device):
        return None
    needs = _NEEDS[name] + (f"; {cpu_backend.unavailable_reason()}" if name == "cpu" and device_type == "cpu" else "")
    return RuntimeError(f"{name} backend unavailable on {device}: needs {needs}" if forced else f"needs {needs}")


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """Concrete backends "auto" could pick on `device` (for `dtype`, when given), in PREFERENCE order:
    flashinfer, flash_attn (fp16/bf16 only), triton (CUDA), torch. Not measured: with small pages
    (e.g. 32 tokens) flash_attn gathers the whole context every layer and may be slower than triton."""
    return [n for n in PREFERENCE
            if _refusal(n, device, dtype, None, None, False, Layout.PAGED, forced=False) is None]


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None,
                    head_dim: int | None = None, block_size: int | None = None) -> str:
    """`select_backend(...).name` for a paged store without features (kernel callers)."""
    return select_backend(name, device, dtype, head_dim, block_size).name


class TritonPlan:
    def __init__(self, batch: PagedBatch, block_size: int):
        self.batch, self.block_size = batch, block_size
        self.tiles = triton_backend.query_tiles(batch)

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        return triton_backend.triton_paged_attention(query, key_cache, value_cache, self.batch, scale, window,
                                                     tiles=self.tiles, softcap=softcap)


SPLIT = "split"     # a step's backend (`StepBackends`): the C++ kernel for its short runs, torch for the rest


class SplitPlan:
    """A step whose sub-requests of at most `rows` query rows (decodes) the C++ kernel attends, blocks read in
    place, and the rest (prefills) torch's SDPA: one [T, Hq, D] output, each row computed by one of them."""

    def __init__(self, batch: PagedBatch, block_size: int, rows: int):
        cu_q, _ = batch.host
        runs = [cu_q[i + 1] - cu_q[i] for i in range(batch.num_seqs)]
        short = [i for i, r in enumerate(runs) if 0 < r <= rows]
        long = [i for i, r in enumerate(runs) if r > rows]
        if not short or not long:
            raise ValueError(f"a split step needs runs of at most {rows} query rows and longer ones, got {runs}")
        self.short = cpu_backend.CpuPlan(batch, block_size, members=short)
        self.long = TorchPlan(batch, block_size, members=long)
        self.long_rows = torch.tensor([t for i in long for t in range(cu_q[i], cu_q[i + 1])], dtype=torch.long)

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
        out = self.short.run(query, key_cache, value_cache, scale, window, softcap)     # zero on the long rows
        long = self.long.run(query, key_cache, value_cache, scale, window, softcap)     # zero on the short rows
        return out.index_copy_(0, self.long_rows, long.index_select(0, self.long_rows))


class KernelState:
    """Kernel state that outlives a step: one per store (or engine), passed to every step's plan.
    Holds FlashInfer's 128 MiB workspace and its wrapper, made on first use, and the longest run of query rows
    a SPLIT step gives the C++ kernel (`StepBackends.short_rows`; 0: the store makes no split step)."""

    def __init__(self, split_rows: int = 0):
        self._flashinfer = None
        self.split_rows = split_rows

    def flashinfer(self, device: torch.device | str):
        if self._flashinfer is None:
            self._flashinfer = flashinfer_backend.FlashInferWrapper(device)
        return self._flashinfer


class KernelPlan:
    """A backend's per-step state for one PagedBatch. `run` has the signature of every backend."""

    def __init__(self, batch: PagedBatch, block_size: int, backend: str = "auto",
                 dtype: torch.dtype | None = None, workspace: torch.Tensor | None = None,
                 state: KernelState | None = None, head_dim: int | None = None):
        self.batch, self.block_size = batch, block_size
        self.validated_for: int | None = None      # num_blocks the batch was last validated against
        if backend == SPLIT:
            if state is None or not state.split_rows:
                raise ValueError("a split step needs the store's KernelState with its split_rows")
            self.backend, self.impl = SPLIT, SplitPlan(batch, block_size, state.split_rows)
            return
        self.backend = resolve_backend(backend, batch.cu_q.device, dtype, head_dim, block_size)
        if self.backend == "torch":
            self.impl = TorchPlan(batch, block_size)
        elif self.backend == "cpu":
            self.impl = cpu_backend.CpuPlan(batch, block_size)
        elif self.backend == "triton":
            self.impl = TritonPlan(batch, block_size)
        elif self.backend == "flashinfer":
            shared = state.flashinfer(batch.cu_q.device) if state is not None and workspace is None else None
            self.impl = flashinfer_backend.FlashInferPlan(batch, block_size, workspace, shared)
        else:
            self.impl = flash_attn_backend.FlashAttnPlan(batch, block_size)

    def run(self, query, key_cache, value_cache, scale: float, window: int | None = None,
            overlay=None, softcap: float | None = None) -> torch.Tensor:
        if overlay is None:
            return self.impl.run(query, key_cache, value_cache, scale, window, softcap)
        if self.backend != "torch":
            raise NotImplementedError(f"the {self.backend} backend cannot read layer-wise overlays (host-resident "
                                      "layers of a LAYERED chunk); use attn_backend='torch' with layerwise_kv")
        return self.impl.run(query, key_cache, value_cache, scale, window, softcap, overlay)


def plan(batch: PagedBatch, block_size: int, backend: str = "auto", dtype: torch.dtype | None = None,
         workspace: torch.Tensor | None = None, state: KernelState | None = None,
         head_dim: int | None = None) -> KernelPlan:
    """Plan one step: call once after building the batch, pass the result to every layer. `dtype` and
    `head_dim`, when given, take part in the backend's selection (`select_backend`)."""
    return KernelPlan(batch, block_size, backend, dtype, workspace, state, head_dim)


def plan_for(batch: PagedBatch, block_size: int, backend: str = "auto", dtype: torch.dtype | None = None,
             state: KernelState | None = None, head_dim: int | None = None) -> KernelPlan:
    """The plan cached on `batch` for (block_size, backend, dtype, head_dim), made on first use: lets
    callers that pass no plan still do the per-batch work once per step rather than once per layer.
    `state`: the caller's long-lived KernelState (without one, a FlashInfer plan makes its own workspace)."""
    key = (block_size, backend, dtype, head_dim)
    if key not in batch.plans:
        batch.plans[key] = KernelPlan(batch, block_size, backend, dtype, state=state, head_dim=head_dim)
    return batch.plans[key]


__all__ = ["BACKENDS", "paged_attention"]


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: PagedBatch) -> None:
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(f"paged_attention: query must be [T, Hq, D] and caches [blocks, block_size, Hkv, D], "
                         f"got {tuple(query.shape)} and {tuple(key_cache.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"paged_attention: key cache {tuple(key_cache.shape)} "
                         f"!= value cache {tuple(value_cache.shape)}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"paged_attention: dtypes differ: query {query.dtype}, key cache {key_cache.dtype}, "
                        f"value cache {value_cache.dtype}")
    hq, d = query.shape[1:]
    hkv, dk = key_cache.shape[2:]
    if d != dk or hq % hkv:
        raise ValueError(f"paged_attention: query has {hq} heads of dim {d}, cache {hkv} heads of dim {dk}; "
                         "head dims must match and query heads be a multiple of KV heads")
    if query.shape[0] != batch.num_tokens:
        raise ValueError(f"paged_attention: query has {query.shape[0]} rows, batch describes {batch.num_tokens}")
    devices = {query.device, key_cache.device, value_cache.device, batch.cu_q.device, batch.block_table.device}
    if len(devices) > 1:
        raise ValueError("paged_attention: query, caches and batch must be on one device, "
                         f"got {sorted(map(str, devices))}")


def paged_attention(
    query: torch.Tensor,        # [T, Hq, D] packed rows of all sub-requests
    key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D] one layer (strided views are fine)
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    batch: PagedBatch,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    validate: bool = True,
    plan: KernelPlan | None = None,
    overlay: Overlay | None = None,
    softcap: float | None = None,
    state: KernelState | None = None,
) -> torch.Tensor:              # [T, Hq, D]
    """Causal attention by absolute position: row t of sub-request i attends to that sub-request's
    keys at positions <= q_pos[t] (and > q_pos[t] - window when a sliding window is given).
    `softcap` c: the scaled logits s become c * tanh(s / c) before masking and softmax (Gemma 2).

    `plan` (kernels.plan(batch, block_size, backend), made once per step) carries the backend's
    per-batch work; without one, the plan is made on the first call and cached on the batch, so
    later layers of the same step reuse it. Validation runs once per plan and pool size.
    `overlay` reads some context blocks of this layer from another tensor (torch backend only).
    `state` (a KernelState kept by the caller across steps) holds FlashInfer's workspace and wrapper."""
    _check(query, key_cache, value_cache, batch)
    if overlay is not None:
        _check_overlay(overlay, key_cache, batch)
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 or None, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"paged_attention: softcap must be > 0 or None, got {softcap}")
    num_blocks, block_size = key_cache.shape[:2]
    if plan is None:
        plan = plan_for(batch, block_size, backend, query.dtype, state, head_dim=query.shape[-1])
    elif plan.batch is not batch or plan.block_size != block_size:
        raise ValueError("paged_attention: the plan was made for another batch or block size")
    elif backend != "auto" and backend != plan.backend:
        raise ValueError(f"paged_attention: backend {backend!r} but the plan is for {plan.backend!r}")
    if validate and plan.validated_for != num_blocks:
        batch.validate(num_blocks, block_size)
        plan.validated_for = num_blocks
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return plan.run(query, key_cache, value_cache, scale, window, overlay, softcap)


def _check_overlay(overlay: Overlay, key_cache: torch.Tensor, batch: PagedBatch) -> None:
    if overlay.table.shape != batch.block_table.shape:
        raise ValueError(f"paged_attention: overlay table {tuple(overlay.table.shape)} must match the block table "
                         f"{tuple(batch.block_table.shape)}")
    if overlay.key.shape[1:] != key_cache.shape[1:] or overlay.key.dtype != key_cache.dtype \
            or overlay.key.device != key_cache.device:
        raise ValueError(f"paged_attention: overlay blocks {tuple(overlay.key.shape[1:])} {overlay.key.dtype} on "
                         f"{overlay.key.device} must match the cache's {tuple(key_cache.shape[1:])} "
                         f"{key_cache.dtype} on {key_cache.device}")
