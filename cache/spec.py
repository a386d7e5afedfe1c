"""Geometry of a model's KV (what the store needs to know of a model) and capacity parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Per-token KV geometry: every layer stores K and V of `num_kv_heads x head_dim` per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    block_size: int = 32          # tokens per block = tokens per chunk (the eviction unit)
    window: int | None = None     # sliding-window attention span, None for full attention

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K + V of all layers for one token."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "pb": 10**15, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_capacity(text: str) -> int | str:
    """A capacity as typed on a command line: digits are tokens (an int), anything else must be a
    size like '2GiB' or '512MB' (kept as the string). The one parser of the server's and demo's flags."""
    text = str(text).strip()
    if text.isdigit():
        return int(text)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse capacity {text!r}: use tokens (digits) or a size like '2GiB' or '512MB'")
    return text


def capacity_in_blocks(capacity: int | str, spec: KVSpec) -> int:
    """`capacity` is a token count (int) or a size string like "2GiB" / "512 MB"; returns whole blocks."""
    if isinstance(capacity, bool) or not isinstance(capacity, (int, str)):
        raise TypeError(f"capacity must be a token count or a size like '2GiB', got {capacity!r}")
    if isinstance(capacity, int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity} tokens")
        return -(-capacity // spec.block_size)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", capacity)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse capacity {capacity!r}: use tokens (an int) or a size like '2GiB' or '512MB'")
    blocks = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) // spec.bytes_per_block
    if blocks <= 0:
        raise ValueError(f"capacity {capacity!r} holds no block of {spec.bytes_per_block} bytes")
    return blocks
