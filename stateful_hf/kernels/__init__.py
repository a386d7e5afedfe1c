"""Attention over paged KV for ragged multi-token queries. Never imports transformers."""

from .batch import Overlay, PagedBatch
from .kernel_plan import (
    BACKENDS,
    BackendChoice,
    KernelPlan,
    KernelState,
    available_backends,
    paged_attention,
    plan,
    resolve_backend,
    select_backend,
)
from .step_backends import StepBackends

__all__ = ["BACKENDS", "BackendChoice", "KernelState", "Overlay", "PagedBatch", "KernelPlan", "available_backends",
           "paged_attention", "plan", "resolve_backend", "select_backend", "StepBackends"]
