"""`ServerStore`: the store as the server sees it (`serve/replica.py`: usage, residency, deletes,
imports, the shutdown's flush; `serve/metrics.py`: statistics and the move ledger at scrape time). The replica's
turns go through its engine (`EngineStore`), never through this door. Every method takes the store lock;
*reads* change nothing. Values that cross: `StoreStats` / `SessionStats`, `TenantUsage`, `FlushReport` (frozen),
the `MoveLedger` (its own lock: `snapshot` and `subscribe` only), and a migration's `SessionExport`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, overload

from ..audit.stats import FlushReport, SessionStats, StoreStats
from ..errors import CapacityError, SessionBusyError, StoreError
from ..eviction.policy import EvictionPolicy
from ..movement.moves import MoveLedger
from ..sessions.tenant import TenantUsage, split_key
from .migration import MigrationStore

__all__ = ["CapacityError", "EvictionPolicy", "FlushReport", "MoveLedger", "ServerStore", "SessionBusyError",
           "SessionStats", "StoreError", "StoreStats", "TenantUsage", "split_key"]


class ServerStore(MigrationStore, Protocol):
    """What a replica and its metrics ask of the store, besides a migration's export and import."""

    @property
    def clock(self) -> Callable[[], float]:
        """The store's clock, in seconds (the time sessions' last activity is in)."""
        ...

    @property
    def policy(self) -> EvictionPolicy:
        """Reads: the eviction policy (its `name`, for /metrics)."""
        ...

    @property
    def moves(self) -> MoveLedger:
        """The ledger of chunk moves between tiers: `snapshot()` totals, `subscribe(fn)` per move batch (a
        listener must not call into the store)."""
        ...

    def __contains__(self, session_id: str) -> bool:
        """Reads: whether the session exists."""
        ...

    def num_tokens(self, session_id: str) -> int:
        """Reads: tokens of the session's history; 0 for an unknown session."""
        ...

    def residency(self, session_id: str, upto: int | None = None) -> dict[str, int]:
        """Reads: tokens of the session per tier (of its first `upto` tokens; None: all)."""
        ...

    def tenant_usage(self) -> dict[str, TenantUsage]:
        """Reads: per tenant, sessions, history tokens and tokens stored in some tier."""
        ...

    @overload
    def stats(self, session_id: None = None) -> StoreStats:
        """Reads: the store's statistics (tiers, counters, traffic)."""
        ...

    @overload
    def stats(self, session_id: str) -> SessionStats:
        """Reads: one session's statistics (its tiers, lease, `last_turn`)."""
        ...

    def delete(self, session_id: str, keep_shared: bool = False) -> None:
        """Changes: forgets the session and frees what only it holds (UnknownSessionError if none)."""
        ...

    def fork(self, session_id: str, new_id: str, token_ids: Sequence[int] | None = None,
             replace: bool = False) -> int:
        """Changes: makes session `new_id` with the session's history (its common prefix with `token_ids`) and
        KV, full chunks shared and the partial last chunk copied (n choices); returns the tokens whose KV came.
        `replace`: an existing `new_id` is deleted first, under the same lock (a held choice continued).
        StoreError if `new_id` exists (without `replace`; SessionBusyError if busy) or sharing is off,
        ValueError if it is another tenant's or the session itself."""
        ...

    def prefetch_shared(self, fraction: float = 0.5) -> int:
        """Changes: moves the shared chunks on the host or disk up to the device, most holders first, into at most
        `fraction` of its free blocks; returns the tokens moved."""
        ...

    def flush(self, timeout: float = 10.0) -> FlushReport | None:
        """Changes: writes to disk, within `timeout` seconds, the idle sessions' chunks not on disk yet and
        commits the index. None without a disk tier."""
        ...

    def close(self, flush: bool = True, timeout: float = 10.0) -> FlushReport | None:
        """Changes: stops write-behind, lands every copy, flushes (with `flush`), commits and releases the disk
        tier; the device and host contents are gone afterwards."""
        ...
