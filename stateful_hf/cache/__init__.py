"""The tiered session KV store. Knows tensors, not transformers."""

from .errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .kv_store import KVStore
from .policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    CostProfile,
    EvictionPolicy,
    FairSharePolicy,
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
from .tenant import DEFAULT_TENANT, TenantUsage, session_key, split_key, tenant_of
from .turn import ChunkNeeds, Committed, Place, PoolSizes, Room, TurnNeeds

__all__ = [
    "DEFAULT_POLICY", "DEFAULT_TENANT", "POLICY_NAMES", "BlockPool", "CapacityError", "Chunk", "ChunkNeeds",
    "ChunkState",
    "CostProfile", "EvictionPolicy", "FairSharePolicy", "KVSpec", "LRUPolicy", "RecencyCostPolicy",
    "RetentionPolicy", "ReturnAwarePolicy", "ReturnEstimator",
    "KVStore", "Session", "SessionBusyError", "SessionStats", "StepBatch", "StepEntry",
    "StoreError", "StoreStats", "TenantUsage", "TurnStats", "UnknownSessionError", "capacity_in_blocks",
    "make_policy", "parse_capacity", "session_key", "split_key", "tenant_of", "Committed", "Place", "PoolSizes", "Room",
    "TurnNeeds",
]
