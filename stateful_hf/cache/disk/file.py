"""One data file of the disk tier: preallocated, memory-mapped slots, and the chunk checksum.

The file holds tensors of `shapes` one after another; each is layer-major ([layers, slots, ...]),
so one layer of a set of slots is read together. A slot's bytes are, per tensor and layer,
`part[layer, slot]` (contiguous).

Checksum of a chunk: xxh3-64 over (its identity tag, its bytes). The tag chains the token ids of
every chunk up to and including it (`identity_tags`), so a checksum proves both the bytes and
whose prefix they are the KV of: a slot holding another chunk's (or another session's) KV, zeros
of a re-extended file, or scribbled bytes all fail it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import shutil
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import xxhash

from ..errors import StoreError
from ..pools.pool import block_runs, libc
from . import index

MADV_WILLNEED, MADV_DONTNEED = 3, 4      # madvise(2) advice (the same on Linux and macOS)


def _madvise(addr: int, length: int, advice: int) -> bool:
    """madvise(2) over [addr, addr + length), addr rounded down to its page; False where it fails or libc
    has no madvise."""
    start = addr - addr % mmap.PAGESIZE
    try:
        return libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(addr + length - start),
                              ctypes.c_int(advice)) == 0
    except (OSError, AttributeError):
        return False


def identity_tags(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Per chunk k, an 8-byte hash of token_ids[: end of chunk k] (a chain: tag_k = H(tag_k-1, ids of k),
    the ids as int64 bytes)."""
    if isinstance(token_ids, array):
        ids = np.frombuffer(token_ids, dtype=np.dtype(token_ids.typecode)).astype(np.int64).tobytes()
    else:
        ids = np.asarray(token_ids, dtype=np.int64).tobytes()
    tags, prev, step = [], b"", 8 * block_size
    for start in range(0, len(ids), step):
        prev = xxhash.xxh3_64_digest(prev + ids[start:start + step])
        tags.append(prev)
    return tags


class DiskFile:
    """`path` mapped as `parts` (tensors of `shapes`, `dtype`), each with `slots` slots on dim 1.

    Opening an existing file that is shorter than its shapes need (truncated) extends it with zeros
    and reports it in `short`; the checksums of the chunks that lived there no longer match.
    Creating one checks free space first and removes the file if anything fails."""

    def __init__(self, path: Path, shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, *, create: bool):
        self.path, self.shapes, self.dtype = path, [tuple(s) for s in shapes], dtype
        self.slots = self.shapes[0][1]
        sizes = [math.prod(sh) for sh in self.shapes]
        self.nbytes = sum(sizes) * torch.empty((), dtype=dtype).element_size()
        self.short = False
        made = False
        try:
            if create or not path.exists():
                free = shutil.disk_usage(path.parent).free
                if free < self.nbytes:
                    raise StoreError(f"cannot create the disk tier file {str(path)!r}: it needs {self.nbytes} "
                                     f"bytes and the filesystem has {free} free; lower disk_capacity")
                self.short = not create              # a file the index names was missing
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                made = True
            else:
                fd = os.open(path, os.O_RDWR)
            self.fd = fd
            size = os.fstat(fd).st_size
            if size < self.nbytes:
                self.short |= not made
                os.posix_fallocate(fd, 0, self.nbytes)   # ENOSPC now, not SIGBUS later
                os.fsync(fd)
            flat = torch.from_file(str(path), shared=True, size=sum(sizes), dtype=dtype)
        except (OSError, RuntimeError) as e:
            self._abandon(made)
            raise StoreError(f"cannot create the disk tier file {str(path)!r} of {self.nbytes} bytes: {e}") from e
        except StoreError:
            self._abandon(made)
            raise
        self.flat = flat
        self.parts = [part.view(sh) for part, sh in zip(flat.split(sizes), self.shapes)]
        item = flat.element_size()
        self._offsets = [item * sum(sizes[:i]) for i in range(len(sizes))]     # each part's first byte
        # per part, its bytes as [layers, slots, slot bytes] (numpy: a slot's piece is one cheap index)
        self._bytes = [p.view(torch.uint8).reshape(*p.shape[:2], math.prod(p.shape[2:]) * item).numpy()
                       for p in self.parts]

    def _abandon(self, made: bool) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)
            self.fd = None
        if made:
            self.path.unlink(missing_ok=True)

    def slot_pieces(self, slot: int):
        """The slot's bytes, as contiguous uint8 arrays (part by part, layer by layer)."""
        for part in self._bytes:
            for layer in range(part.shape[0]):
                yield part[layer, slot]

    def prefetch(self, slots: Sequence[int]) -> None:
        """Have the OS read these slots' bytes now, each run of consecutive slots one range per part and layer
        (MADV_WILLNEED): the checksum and the copy up that follow find them in the page cache, read as one
        queue of requests instead of fault by fault, and no fault reads ahead past them into other slots'
        bytes (a file is laid out layer by layer, and a device's readahead window can be MiBs: reading 16
        slots of a 34-slot file read twice their bytes before). Best effort: nothing changes if it fails."""
        ordered = sorted(set(slots))
        runs = block_runs(ordered, ordered)                     # (first slot, first slot, slots)
        base = self.flat.data_ptr()
        for part, offset in zip(self._bytes, self._offsets, strict=True):
            layers, count, size = part.shape
            for layer in range(layers):
                for a, _, n in runs:
                    _madvise(base + offset + (layer * count + a) * size, n * size, MADV_WILLNEED)

    def checksum(self, tag: bytes, slot: int) -> int:
        """xxh3-64 of (tag, the slot's bytes), as a signed 64-bit integer (an SQLite INTEGER)."""
        h = xxhash.xxh3_64(tag)
        for piece in self.slot_pieces(slot):
            h.update(piece)
        return int.from_bytes(h.digest(), "little", signed=True)

    def write(self, part: int, layer: int, slots: Sequence[int], rows: torch.Tensor) -> None:
        """rows[i] (CPU, this file's dtype) into `parts[part][layer, slots[i]]` through the file (pwrite),
        not the mapping: flushing pages dirtied through a mapping costs with the file's size (about 1 ms
        a GiB on ext4 here), flushing written pages with what was written. The mapping sees them at once."""
        size = self._bytes[part].shape[2]                       # bytes of one slot of one layer
        raw = rows.contiguous().view(torch.uint8).reshape(len(slots), size).numpy()
        base = self._offsets[part] + layer * self.parts[part].shape[1] * size
        i = 0
        while i < len(slots):                  # one pwrite per run of consecutive slots
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            buf, at = memoryview(raw[i:j]).cast("B"), base + slots[i] * size
            while buf:
                n = os.pwrite(self.fd, buf, at)
                buf, at = buf[n:], at + n
            i = j

    def flush(self) -> None:
        """Make every write into the mapping durable (raises OSError if it cannot)."""
        index.durability_point("data-flush")
        os.fdatasync(self.fd)

    def copy_from(self, other: DiskFile, src: list[int], dst: list[int]) -> None:
        """self[:, dst] = other[:, src], every part (same shapes but the slot count)."""
        s, d = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
        for a, b in zip(other.parts, self.parts):
            for layer in range(a.shape[0]):
                b[layer].index_copy_(0, d, a[layer].index_select(0, s))

    def drop_page_cache(self) -> bool:
        """Write back and evict the file's pages (unmapped first: MADV_DONTNEED, 4). False where the
        unmapping is not available (reads of mapped pages may then stay warm)."""
        unmapped = _madvise(self.flat.data_ptr(), self.nbytes, MADV_DONTNEED)
        os.fsync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return unmapped

    def close(self) -> None:
        """Close the file and drop this object's views of its mapping (the pools over it drop theirs:
        `Quarantined.unmap`); the mapping is gone once no view is left."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.flat, self.parts, self._bytes = None, [], []
