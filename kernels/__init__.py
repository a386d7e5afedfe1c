"""Attention over paged KV for ragged multi-token queries. Never imports transformers."""

from .attention import BACKENDS, paged_attention, write_kv
from .batch import PagedBatch

__all__ = ["BACKENDS", "PagedBatch", "paged_attention", "write_kv"]
