"""One queued copy between pools (`Copy`) and the events of its layers: CUDA events, or the CPU
async emulator's `EmulatedEvent`, which performs a layer of the copy when it is waited on. The
transfer engine (`transfer.py`) makes, polls and reaps them; its docstring has the ordering rules
they keep."""

from __future__ import annotations

import torch

from ..pools.tier import TierPool


def poison(pool: TierPool, ids: list[int]) -> None:
    """Every layer of blocks `ids` of `pool` reads NaN."""
    idx = torch.tensor(ids, device=pool.device)
    for layer in range(pool.spec.num_layers):
        blocks = pool.read(layer, idx)
        pool.write(layer, idx, torch.full_like(blocks, float("nan")))


class Copy:
    """One queued copy: blocks src_ids of `src` to dst_ids of `dst`, every layer. `events[l]` is a
    CUDA event (or an EmulatedEvent); `staged[l]` the pinned host buffer of layer l: the one a
    device -> host layer lands in before it is written into `dst`, or the one a host -> device layer
    is read from; None for the emulator."""

    __slots__ = ("src", "src_ids", "dst", "dst_ids", "events", "staged", "emulated", "_landed")

    def __init__(self, src: TierPool, src_ids: list[int], dst: TierPool, dst_ids: list[int], emulated: bool):
        self.src, self.src_ids, self.dst, self.dst_ids = src, list(src_ids), dst, list(dst_ids)
        self.emulated = emulated
        self.events: list = []
        self.staged: list[torch.Tensor | None] = []
        self._landed = [False] * src.spec.num_layers

    def touches(self, pool: TierPool, blocks) -> set[int]:
        """The blocks of `blocks` (of `pool`) this copy reads or writes."""
        out = set()
        if pool is self.src:
            out |= set(blocks).intersection(self.src_ids)
        if pool is self.dst:
            out |= set(blocks).intersection(self.dst_ids)
        return out

    def _write(self, layer: int, blocks: torch.Tensor) -> None:
        self.dst.write(layer, torch.tensor(self.dst_ids, device=self.dst.device), blocks)

    def land(self, layer: int) -> None:
        """Layer `layer` is in `dst` when this returns (waits on its event; emulated: performs it)."""
        if self._landed[layer]:
            return
        if self.emulated:
            self._write(layer, self.src.read(layer, torch.tensor(self.src_ids, device=self.src.device))
                        .to(self.dst.device))
        else:
            self.events[layer].synchronize()
            if self.dst.device.type == "cpu":      # device -> host: the host-side write, after the event
                self._write(layer, self.staged[layer])
            self.staged[layer] = None              # the pinned buffer may be reused from now on
        self._landed[layer] = True

    def poll(self, wait: bool) -> bool:
        """True when every layer has landed; lands those whose event completed (all, if `wait`)."""
        for layer, done in enumerate(self._landed):
            if not done:
                if not wait and (self.emulated or not self.events[layer].query()):
                    return False
                self.land(layer)
        return True


class EmulatedEvent:
    """Stands for the CUDA event recorded after layer `layer` of `copy`."""

    __slots__ = ("copy", "layer")

    def __init__(self, copy: Copy, layer: int):
        self.copy, self.layer = copy, layer

    def query(self) -> bool:
        return self.copy._landed[self.layer]

    def synchronize(self) -> None:
        self.copy.land(self.layer)
