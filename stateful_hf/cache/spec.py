"""Geometry of a model's KV (what the store needs to know of a model) and capacity parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..kernels.blocks import blocks_for


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Per-token KV geometry: every layer stores K and V of `num_kv_heads x head_dim` per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    block_size: int = 32          # tokens per block = tokens per chunk (the eviction unit)
    windows: tuple[int | None, ...] = ()   # [num_layers] sliding-window span per layer (None: full); () all full

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"KVSpec.windows has {len(self.windows)} entries for {self.num_layers} layers")

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
        return _addressable(blocks_for(capacity, spec.block_size), capacity, spec)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", capacity)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse capacity {capacity!r}: use tokens (an int) or a size like '2GiB' or '512MB'")
    blocks = int(float(m.group(1)) * _UNITS[m.group(2).lower()]) // spec.bytes_per_block
    if blocks <= 0:
        raise ValueError(f"capacity {capacity!r} holds no block of {spec.bytes_per_block} bytes")
    return _addressable(blocks, capacity, spec)


# a pool is one tensor: its bytes must be countable in int64 (torch: "Storage size calculation overflowed")
_MAX_POOL_BYTES = 2**62


def _addressable(blocks: int, capacity: int | str, spec: KVSpec) -> int:
    if blocks * spec.bytes_per_block > _MAX_POOL_BYTES:
        raise ValueError(f"capacity {capacity!r} is {blocks * spec.bytes_per_block:.3g} bytes of KV, more than one "
                         f"pool tensor can address ({_MAX_POOL_BYTES:.3g} bytes); give a size this machine holds, "
                         "like '2GiB'")
    return blocks
