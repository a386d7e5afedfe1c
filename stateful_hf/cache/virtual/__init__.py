"""The virtual layout (vAttention): each session's KV contiguous in a reserved virtual range, physical
pages committed on demand (CUDA: the driver's virtual memory API) and mapped ahead by a background
thread, so dense kernels read a session without a block table. A feature: it runs only in a store
made with `layout="virtual"`; with the default paged layout no module here runs.
"""

from .mapper import PageMapper
from .pool import NoSlotError, VirtualPool
from .reservation import CudaReservation

__all__ = ["CudaReservation", "NoSlotError", "PageMapper", "VirtualPool"]
