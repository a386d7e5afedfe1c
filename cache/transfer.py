"""Copies of chunks between pools, layer by layer.

On CUDA the copies run on a side stream and record one event per layer; the attention of layer l
waits on event l only (Pensieve's pipelined swap-in: the batch starts before the swap-in ends).
Elsewhere the same code runs synchronously and returns no events.
"""

from __future__ import annotations

import torch

from .pool import BlockPool


class Transfer:
    """Owns the copy stream. Contract: `copy` may be called with the store lock held; it never
    touches free lists or chunk tables (the store does)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last: list = []   # events of the latest swap-in, to keep swap-out behind it

    def copy(self, src: BlockPool, src_ids: list[int], dst: BlockPool, dst_ids: list[int]) -> list | None:
        """Blocks src_ids of `src` to dst_ids of `dst`, every layer; per-layer CUDA events, or None when done."""
        if not src_ids:
            return None
        layers = src.spec.num_layers
        s_idx = torch.tensor(src_ids, device=src.device)
        d_idx = torch.tensor(dst_ids, device=dst.device)
        if self.stream is None or (src.device.type != "cuda" and dst.device.type != "cuda"):
            for layer in range(layers):
                dst.write(layer, d_idx, src.read(layer, s_idx).to(dst.device))
            return None
        events = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for layer in range(layers):
                part = src.read(layer, s_idx)
                if part.device.type == "cpu":
                    part = part.pin_memory()
                dst.write(layer, d_idx, part.to(dst.device, non_blocking=True))
                ev = torch.cuda.Event()
                ev.record(self.stream)
                events.append(ev)
        if dst.device.type == "cuda":
            self._last = events
        return events

    def swap_in_pending(self) -> bool:
        """True while a swap-in copy is in flight (swap-out waits: concurrent copies lose bandwidth)."""
        return any(not ev.query() for ev in self._last)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
