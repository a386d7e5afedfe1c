"""Backend choice and the per-step plan every layer of one engine step reuses.

    plan = kernels.plan(batch, block_size, backend="auto")      # once per step, after the batch is built
    out = kernels.paged_attention(q, k_cache, v_cache, batch, plan=plan)   # in every layer

A plan holds what a backend derives from the batch alone (groups and gather indices, query tiles,
FlashInfer's planned wrapper, run metadata), so layers do no host work and no host-device syncs.
No globals: the caller owns the plan and a KernelState it keeps across steps (one per store or
engine: FlashInfer's workspace and wrapper, made on first use and re-planned by each step's plan).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import flash_attn_backend, flashinfer_backend, triton_backend
from .batch import PagedBatch
from .torch_batched import TorchPlan

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")
PREFERENCE = ("flashinfer", "flash_attn", "triton", "torch")   # auto's order: fixed, not measured
LAYOUTS = ("paged", "virtual")
# Each GPU backend module's supports(dtype, head_dim, block_size) -> None or why not; the torch backend
# serves every device, dtype, head_dim and block size, and alone reads LayerKV's overlays.
_GPU = {"flashinfer": flashinfer_backend, "flash_attn": flash_attn_backend, "triton": triton_backend}
_NEEDS = {"flashinfer": "CUDA and flashinfer-python", "flash_attn": "CUDA (sm80+) and flash-attn",
          "triton": "the triton package and CUDA, or TRITON_INTERPRET=1 set before first use"}


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """`select_backend`'s answer: a concrete backend and, for "auto", one line per backend passed over
    in preference order ("triton skipped: head_dim 16 not in (64, 80, 96, 128, 256)")."""

    name: str
    skipped: tuple[str, ...] = ()


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None,
                   head_dim: int | None = None, block_size: int | None = None, *, layerwise_kv: bool = False,
                   layout: str = "paged") -> BackendChoice:
    """The paged-attention backend for `name` serving a store on `device` with this dtype, head_dim,
    block size and features (None: not checked). "auto" walks PREFERENCE and passes over, logging
    one line each, any backend that cannot serve it (triton only on CUDA; the CPU always gets torch).
    A backend forced by name raises: ValueError for an unknown name or one that cannot serve the dtype,
    head_dim, block size or features (naming what it supports), RuntimeError for a missing package or
    device. Features: `layerwise_kv` (LayerKV's host-resident layers are overlays only torch reads);
    layout "virtual" attends through kernels/dense.py, never a paged backend, so it names torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {name!r}; choose from {BACKENDS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
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
             block_size: int | None, layerwise_kv: bool, layout: str, *, forced: bool) -> Exception | None:
    """Why `name` cannot serve this store (None: it can). Checked in order: (auto only) a CUDA device,
    then features, dtype, head_dim and block size (ValueError), then package and device (RuntimeError).
    A forced backend's message names the backend and what it supports; auto's is the bare reason."""
    if name == "torch":
        return None
    if not forced and torch.device(device).type != "cuda":
        return RuntimeError("needs CUDA" + (" (the CPU runs it interpreted only when forced)" if name == "triton"
                                            else ""))
    if layerwise_kv:
        why = "layerwise_kv needs attn_backend='torch' (only the torch backend reads LayerKV's host-resident " \
              "layers, its overlays)"
    elif layout == "virtual":
        why = "layout='virtual' attends through kernels/dense.py, never a paged backend (use 'torch' or 'auto')"
    else:
        why = _GPU[name].supports(dtype, head_dim, block_size)
    if why is not None:
        return ValueError(f"attn_backend={name!r} unsupported here: {why}" if forced else why)
    if _GPU[name].available(device):
        return None
    return RuntimeError(f"{name} backend unavailable on {device}: needs {_NEEDS[name]}" if forced
                        else f"needs {_NEEDS[name]}")


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """Concrete backends "auto" could pick on `device` (for `dtype`, when given), in PREFERENCE order:
    flashinfer, flash_attn (fp16/bf16 only), triton (CUDA), torch. Not measured: with small pages
    (e.g. 32 tokens) flash_attn gathers the whole context every layer and may be slower than triton."""
    return [n for n in PREFERENCE
            if _refusal(n, device, dtype, None, None, False, "paged", forced=False) is None]


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


class KernelState:
    """Kernel state that outlives a step: one per store (or engine), passed to every step's plan.
    Holds FlashInfer's 128 MiB workspace and its wrapper, made on first use."""

    def __init__(self):
        self._flashinfer = None

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
        self.backend = resolve_backend(backend, batch.cu_q.device, dtype, head_dim, block_size)
        if self.backend == "torch":
            self.impl = TorchPlan(batch, block_size)
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
