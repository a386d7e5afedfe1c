"""The tiered session KV store. Knows tensors, not transformers."""

from .audit.stats import SessionStats, StoreStats
from .errors import CapacityError, SessionBusyError, StoreError, UnknownSessionError
from .eviction.policy import (
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
from .eviction.returns import ReturnEstimator
from .kv_store import KVStore
from .pools.pool import BlockPool
from .sessions.session import Chunk, ChunkState, Session, TurnStats
from .sessions.tenant import DEFAULT_TENANT, TenantUsage, session_key, split_key, tenant_of
from .spec import KVSpec, capacity_in_blocks, parse_capacity
from .step import StepBatch, StepEntry
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
