"""Pools of disk slots: a freed slot waits in limbo until the committed index no longer names it."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import torch

from ..hidden.states import HiddenPool
from ..pools.pool import BlockPool

if TYPE_CHECKING:
    from .file import DiskFile


def _empty(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of `t`'s kind in place of a view of a file's mapping."""
    return t.new_empty((0,) * t.dim())


class SlotChecksums:
    """Per slot of a disk pool: the checksum of the chunk written there, if any, and whether it was
    proven (read and found to match) since written or opened. 9 bytes a slot, preallocated."""

    __slots__ = ("_sums", "_state")

    NONE, KNOWN, PROVEN = 0, 1, 2

    def __init__(self, n: int):
        self._sums = array("q", bytes(8 * n))
        self._state = bytearray(n)

    def get(self, slot: int) -> int | None:
        return self._sums[slot] if self._state[slot] else None

    def __getitem__(self, slot: int) -> int:
        assert self._state[slot], f"disk slot {slot} has no checksum"
        return self._sums[slot]

    def set(self, slot: int, checksum: int, proven: bool = False) -> None:
        self._sums[slot], self._state[slot] = checksum, self.PROVEN if proven else self.KNOWN

    def prove(self, slot: int) -> None:
        assert self._state[slot], f"disk slot {slot} has no checksum"
        self._state[slot] = self.PROVEN

    def proven(self, slot: int) -> bool:
        return self._state[slot] == self.PROVEN

    def forget(self, slot: int) -> None:
        self._state[slot] = self.NONE

    def slots(self) -> set[int]:
        """The slots with a checksum. O(slots): integrity checks only."""
        return {i for i, st in enumerate(self._state) if st}


class Quarantined:
    """A pool of disk slots: freed slots wait in `limbo` until a committed index no longer names
    them; `checksums` holds what is known of the slots in use."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.limbo: list[int] = []
        self.checksums = SlotChecksums(self.num_blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.checksums.forget(b)
        self.limbo.extend(blocks)

    def free_unnamed(self, blocks: list[int]) -> None:
        """Free slots no committed index ever named (a write that was not made durable)."""
        for b in blocks:
            self.checksums.forget(b)
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

    def check(self, owned: set[int], pending: set[int] = frozenset()) -> None:
        """`owned`: slots chunks (or disk copies) own; `pending`: those of them being written (no checksum yet)."""
        waiting = set(self.limbo)
        assert len(waiting) == len(self.limbo), "a disk slot is in limbo twice"
        assert not waiting & set(self.free_ids()), "a disk slot is both free and in limbo"
        assert not waiting & owned, f"disk slots both owned and in limbo: {sorted(waiting & owned)[:8]}"
        known = self.checksums.slots() | set(pending)
        assert known == owned, (f"disk slots owned without a checksum {sorted(owned - known)[:8]} or checksums of "
                                f"slots no chunk owns {sorted(known - owned)[:8]}")
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
