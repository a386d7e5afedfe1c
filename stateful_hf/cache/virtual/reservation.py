"""CUDA side of the virtual layout: reserve a virtual address range with the driver's virtual memory
API (cuda-python) and back it with physical memory in allocation-granularity pieces on demand.

Used only where CUDA and `cuda-python` are present (tests skip otherwise). The range is exposed to
torch without a copy through `__cuda_array_interface__`. Call order follows the CUDA driver docs:
cuMemGetAllocationGranularity -> cuMemAddressReserve -> per piece cuMemCreate, cuMemMap,
cuMemSetAccess; release: cuMemUnmap, cuMemRelease; cuMemAddressFree at the end. Piece 0 is mapped
at reservation, before any tensor is made over the range, and stays mapped until `close`: torch
asks the driver for a foreign pointer's device, and an unmapped address has none; the tensor's base
address must stay valid while the tensor lives. torch's primary context is made current first
(torch.cuda.init) so the driver calls run in the context torch uses. Pieces are reference-counted by
the blocks that use them; a fresh piece is zeroed. acquire and release may run on another thread
(the background mapper): they make torch's primary context current on the calling thread first
(cuCtxSetCurrent), as the driver API is per-thread.
"""

from __future__ import annotations

import torch


def _check(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


class CudaReservation:
    """`nbytes` (rounded up to the allocation granularity) of reserved virtual addresses on `device`,
    backed piece by piece; piece 0, the anchor, is mapped from construction to `close`."""

    def __init__(self, nbytes: int, device: torch.device):
        from cuda.bindings import driver  # cuda-python

        torch.cuda.init()
        self._drv = driver
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._dev = _check(driver.cuDeviceGet(index))
        self._ctx = _check(driver.cuDevicePrimaryCtxRetain(self._dev))     # the context torch uses
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        self._prop = prop
        self.granularity = int(_check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)))
        self.nbytes = -(-nbytes // self.granularity) * self.granularity
        self.base = int(_check(driver.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        access = driver.CUmemAccessDesc()
        access.location = prop.location
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self._handles: dict[int, object] = {}     # piece index -> physical allocation handle
        self._refs: dict[int, int] = {}           # piece index -> blocks using it (+1 on piece 0: the anchor)
        try:
            self.acquire(0, 1)                    # the anchor: mapped before tensor(), released only by close()
        except Exception:
            _check(driver.cuMemAddressFree(self.base, self.nbytes))
            _check(driver.cuDevicePrimaryCtxRelease(self._dev))
            raise

    @property
    def mapped_bytes(self) -> int:
        return len(self._handles) * self.granularity

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The whole reservation as one tensor over the mapped anchor (piece 0); any other range must be
        acquired before it is touched."""
        base, nbytes = self.base, self.nbytes

        class _Range:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (base, False), "version": 3}

        n = 1
        for d in shape:
            n *= d
        return torch.as_tensor(_Range(), device=self.device).view(dtype)[:n].view(shape)

    def _pieces(self, offset: int, length: int) -> range:
        return range(offset // self.granularity, -(-(offset + length) // self.granularity))

    def acquire(self, offset: int, length: int) -> None:
        """Back [offset, offset + length) with physical memory."""
        drv = self._drv
        _check(drv.cuCtxSetCurrent(self._ctx))
        for piece in self._pieces(offset, length):
            if piece not in self._handles:
                handle = _check(drv.cuMemCreate(self.granularity, self._prop, 0))
                addr = self.base + piece * self.granularity
                _check(drv.cuMemMap(addr, self.granularity, 0, handle, 0))
                _check(drv.cuMemSetAccess(addr, self.granularity, [self._access], 1))
                _check(drv.cuMemsetD8(addr, 0, self.granularity))   # no session sees another's data
                self._handles[piece] = handle
            self._refs[piece] = self._refs.get(piece, 0) + 1

    def release(self, offset: int, length: int) -> None:
        """Drop one reference to each piece of the range; unmap and free pieces nobody uses. The caller
        synchronises every stream that wrote or reads the range first (cuMemUnmap is not stream-ordered)."""
        _check(self._drv.cuCtxSetCurrent(self._ctx))
        for piece in self._pieces(offset, length):
            self._refs[piece] -= 1
            if self._refs[piece] == 0:
                del self._refs[piece]
                self._unmap(piece)

    def _unmap(self, piece: int) -> None:
        _check(self._drv.cuMemUnmap(self.base + piece * self.granularity, self.granularity))
        _check(self._drv.cuMemRelease(self._handles.pop(piece)))

    def close(self) -> None:
        for piece in list(self._handles):
            self._unmap(piece)
        self._refs.clear()
        _check(self._drv.cuMemAddressFree(self.base, self.nbytes))
        _check(self._drv.cuDevicePrimaryCtxRelease(self._dev))
