"""Pools of disk slots: a freed slot waits in limbo until the committed index no longer names it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..hidden.states import HiddenPool
from ..pool import BlockPool

if TYPE_CHECKING:
    from .file import DiskFile


def _empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of `t`'s kind in place of a view of a file's mapping."""
    return t.new_empty((0,) * t.dim())


class Quarantined:
    """A pool of disk slots: freed slots wait in `limbo` until a committed index no longer names
    them; `checksums` / `verified` hold what is known of the slots in use."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limbo: list[int] = []
        self.checksums: dict[int, int] = {}     # slot -> checksum of the chunk written there
        self.verified: set[int] = set()         # slots read and found to match since written or opened

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.checksums.pop(b, None)
            self.verified.discard(b)
        self.limbo.extend(blocks)

    def free_unnamed(self, blocks: list[int]) -> None:
        """Free slots no committed index ever named (a write that was not made durable)."""
        for b in blocks:
            self.checksums.pop(b, None)
            self.verified.discard(b)
        super().free(blocks)

    def release_limbo(self) -> None:
        super().free(self.limbo)
        self.limbo = []

    def unmap(self) -> None:
        """Let go of the slots' storage (views of a disk file's mapping) when the tier closes, so the
        mapping goes with the file's own views, not at the next garbage collection. The pool cannot
        be read afterwards."""
        if isinstance(self, HiddenPool):
            self.hidden, self.kv = _empty(self.hidden), _empty(self.kv)
            self.data = self.kv
        else:
            self.data = _empty(self.data)

    def check(self, owned: set[int]) -> None:
        waiting = set(self.limbo)
        assert len(waiting) == len(self.limbo), "a disk slot is in limbo twice"
        assert not waiting & set(self.free_ids()), "a disk slot is both free and in limbo"
        assert not waiting & owned, f"disk slots both owned and in limbo: {sorted(waiting & owned)[:8]}"
        assert set(self.checksums) == owned, (
            f"disk slots owned without a checksum {sorted(owned - set(self.checksums))[:8]} or checksums of "
            f"slots no chunk owns {sorted(set(self.checksums) - owned)[:8]}")
        BlockPool.check(self, owned | waiting)


class DiskPool(Quarantined, BlockPool):
    """Slots of the disk tier's K/V file, read through its mapping and written through the file."""

    slice_blocks = False         # every write is `write`'s (copy_now does not slice-copy into the mapping)

    def __init__(self, *args, file: DiskFile, **kwargs):
        super().__init__(*args, **kwargs)
        self.file = file

    def write(self, layer: int, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        self.file.write(0, layer, ids.tolist(), blocks.to("cpu", self.data.dtype))


class DiskHiddenPool(Quarantined, HiddenPool):
    """Slots of the disk tier's hidden file ([hidden layers], [K/V layers] parts), written through the file."""

    def __init__(self, *args, file: DiskFile, **kwargs):
        super().__init__(*args, **kwargs)
        self.file = file

    def put(self, part: int, start: int, rows: torch.Tensor) -> None:
        for layer in range(rows.shape[0]):
            self.file.write(part, layer, range(start, start + rows.shape[1]), rows[layer])
