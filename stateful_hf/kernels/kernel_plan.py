"""Backend choice and the per-step plan every layer of one engine step reuses.

    plan = kernels.plan(batch, block_size, backend="auto")      # once per step, after the batch is built
    out = kernels.paged_attention(q, k_cache, v_cache, batch, plan=plan)   # in every layer

A plan holds what a backend derives from the batch alone (groups and gather indices, query tiles,
FlashInfer's planned wrapper, run metadata), so layers do no host work and no host-device syncs.
No globals: the caller owns the plan and a KernelState it keeps across steps (one per store or
engine: FlashInfer's workspace and wrapper, made on first use and re-planned by each step's plan).
"""

from __future__ import annotations

import torch

from . import flash_attn_backend, flashinfer_backend, triton_backend
from .batch import PagedBatch
from .torch_batched import TorchPlan

BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")
_HALF = (torch.float16, torch.bfloat16)


def available_backends(device: torch.device | str, dtype: torch.dtype | None = None) -> list[str]:
    """Concrete backends usable on `device` (for `dtype`, when given), in a fixed order of preference:
    flashinfer, flash_attn (fp16/bf16 only), triton (CUDA), torch. Not measured: with small pages
    (e.g. 32 tokens) flash_attn gathers the whole context every layer and may be slower than triton."""
    found = []
    if dtype is None or dtype in _HALF:
        found += [n for n, mod in (("flashinfer", flashinfer_backend), ("flash_attn", flash_attn_backend))
                  if mod.available(device)]
    if torch.device(device).type == "cuda" and triton_backend.available(device):
        found.append("triton")
    found.append("torch")     # on the CPU the interpreted triton kernel is a test vehicle, not a fast path
    return found


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The concrete backend for `name` on `device`: "auto" -> the first of `available_backends` (a
    fixed order, not a measurement; torch on the CPU)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {name!r}; choose from {BACKENDS}")
    if name == "auto":
        return available_backends(device, dtype)[0]
    if name == "triton" and not triton_backend.available(device):
        raise RuntimeError(f"triton backend unavailable on {device}: needs the triton package and CUDA, "
                           "or TRITON_INTERPRET=1 set before first use")
    if name == "flashinfer" and not flashinfer_backend.available(device):
        raise RuntimeError(f"flashinfer backend unavailable on {device}: needs CUDA and flashinfer-python")
    if name == "flash_attn" and not flash_attn_backend.available(device):
        raise RuntimeError(f"flash_attn backend unavailable on {device}: needs CUDA and flash-attn")
    return name


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
                 state: KernelState | None = None):
        self.batch, self.block_size = batch, block_size
        self.validated_for: int | None = None      # num_blocks the batch was last validated against
        self.backend = resolve_backend(backend, batch.cu_q.device, dtype)
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
         workspace: torch.Tensor | None = None, state: KernelState | None = None) -> KernelPlan:
    """Plan one step: call once after building the batch, pass the result to every layer."""
    return KernelPlan(batch, block_size, backend, dtype, workspace, state)


def plan_for(batch: PagedBatch, block_size: int, backend: str = "auto", dtype: torch.dtype | None = None,
             state: KernelState | None = None) -> KernelPlan:
    """The plan cached on `batch` for (block_size, backend, dtype), made on first use: lets callers that
    pass no plan still do the per-batch work once per step rather than once per layer. `state`: the
    caller's long-lived KernelState (without one, a FlashInfer plan makes its own workspace)."""
    key = (block_size, backend, dtype)
    if key not in batch.plans:
        batch.plans[key] = KernelPlan(batch, block_size, backend, dtype, state=state)
    return batch.plans[key]
