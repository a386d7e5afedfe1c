"""Attention over paged KV for ragged multi-token queries. Never imports transformers."""

from .batch import Overlay, PagedBatch
from .dispatch import BACKENDS, paged_attention
from .plan import KernelState, StepPlan, available_backends, plan, resolve_backend

__all__ = ["BACKENDS", "KernelState", "Overlay", "PagedBatch", "StepPlan", "available_backends", "paged_attention",
           "plan", "resolve_backend"]
