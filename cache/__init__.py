"""The tiered session KV store. Knows tensors, not transformers."""

from .errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    CostProfile,
    EvictionPolicy,
    LRUPolicy,
    RecencyCostPolicy,
    RetentionPolicy,
    ReturnAwarePolicy,
    make_policy,
)
from .pool import BlockPool
from .returns import ReturnEstimator
from .session import Chunk, ChunkState, Session, TurnStats
from .spec import KVSpec, capacity_in_blocks, parse_capacity
from .stats import SessionStats, StoreStats
from .step import StepBatch, StepEntry
from .store import SessionStore

__all__ = [
    "DEFAULT_POLICY", "POLICY_NAMES", "BlockPool", "CapacityError", "Chunk", "ChunkState", "CostProfile",
    "EvictionPolicy", "KVSpec", "LRUPolicy", "RecencyCostPolicy", "RetentionPolicy", "ReturnAwarePolicy",
    "ReturnEstimator", "Session", "SessionBusyError", "SessionStats", "SessionStore", "StepBatch", "StepEntry",
    "StoreError", "StoreStats", "TurnStats", "UnknownSessionError", "capacity_in_blocks", "make_policy",
    "parse_capacity",
]
