"""`MigrationStore`: the store as KV migration between replicas sees it (`serve/migrate.py`): a session's token ids
and stored K/V out of one store, into another. Every method takes the store lock; neither waits for a busy
session (SessionBusyError at once: the caller retries). The value that crosses is `SessionExport` (frozen
geometry, the ids, one record per stored chunk)."""

from __future__ import annotations

from typing import Protocol

from ..errors import SessionBusyError
from ..movement.migration import SessionExport

__all__ = ["MigrationStore", "SessionBusyError", "SessionExport"]


class MigrationStore(Protocol):
    """What a migration asks of the store it moves a session out of, and tells the one it moves it into."""

    def export_session(self, session_id: str) -> SessionExport:
        """Reads: the idle session's token ids and every chunk's stored K/V (any tier), copied out
        (SessionBusyError while a turn holds it; UnknownSessionError if none). Changes nothing."""
        ...

    def import_session(self, exp: SessionExport) -> int:
        """Changes: `exp` becomes this store's session `exp.session_id` (any older copy deleted), its stored
        chunks on the device (moving idle sessions' chunks down by the policy). Returns the tokens whose KV came
        along (ValueError: another geometry; SessionBusyError: the session is leased here)."""
        ...
