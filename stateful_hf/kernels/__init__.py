"""Attention over paged KV for ragged multi-token queries. Never imports transformers."""

from .batch import Overlay, PagedBatch
from .dispatch import BACKENDS, paged_attention
from .kernel_plan import KernelPlan, KernelState, available_backends, plan, resolve_backend

__all__ = ["BACKENDS", "KernelState", "Overlay", "PagedBatch", "KernelPlan", "available_backends", "paged_attention",
           "plan", "resolve_backend"]
