"""The tiered session KV store. Knows tensors, not transformers."""

from .errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .policy import CostProfile, EvictionPolicy, LRUPolicy, RetentionPolicy
from .pool import BlockPool
from .session import Chunk, ChunkState, Session, TurnStats
from .spec import KVSpec, capacity_in_blocks
from .stats import SessionStats, StoreStats
from .step import StepBatch, StepEntry
from .store import SessionStore

__all__ = [
    "BlockPool", "CapacityError", "Chunk", "ChunkState", "CostProfile", "EvictionPolicy", "KVSpec", "LRUPolicy",
    "RetentionPolicy", "Session", "SessionBusyError", "SessionStats", "SessionStore", "StepBatch", "StepEntry",
    "StoreError", "StoreStats", "TurnStats", "UnknownSessionError", "capacity_in_blocks",
]
