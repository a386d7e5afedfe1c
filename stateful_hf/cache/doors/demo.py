"""`DemoStore`: the store as the chat demo sees it (`demo/backend.py`: how much of a chat's prompt the store
holds and where, the tiers' bars, a chat's deletion). Its turns go through the engine. Every method takes the
store lock; *reads* change nothing. Values that cross: `StoreStats` / `SessionStats` (frozen)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, overload

from ..audit.stats import SessionStats, StoreStats

__all__ = ["DemoStore", "SessionStats", "StoreStats"]


class DemoStore(Protocol):
    """What the demo's backend asks of the store."""

    def __contains__(self, session_id: str) -> bool:
        """Reads: whether the session exists."""
        ...

    def match_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """Reads: the longest common prefix of the session's history and `token_ids` (what a turn would keep)."""
        ...

    def residency(self, session_id: str, upto: int | None = None) -> dict[str, int]:
        """Reads: tokens of the session per tier (of its first `upto` tokens; None: all)."""
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
        """Changes: forgets the session and frees what only it holds."""
        ...
