"""KV migration between replicas: the store's own `export_session` / `import_session`
(`stateful_hf/cache/movement/migration.py`: what moves and how), waiting here while a turn holds the session,
since the store answers a busy session with SessionBusyError at once.

Between the import and the end of its moves a turn must not start on the session: the caller
(`Replica`) holds the session's gate for the whole import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ..cache.doors.migration import MigrationStore, SessionBusyError, SessionExport

__all__ = ["SessionExport", "export_session", "import_session"]

_TIMEOUT = 30.0
T = TypeVar("T")


def _when_idle(call: Callable[[], T], timeout: float) -> T:
    """`call()`, tried again every 5 ms while the session is busy, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except SessionBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def export_session(store: MigrationStore, session_id: str, timeout: float = _TIMEOUT) -> SessionExport:
    """The session's token ids and every chunk whose K/V is stored (any tier)."""
    return _when_idle(lambda: store.export_session(session_id), timeout)


def import_session(store: MigrationStore, exp: SessionExport, timeout: float = _TIMEOUT) -> int:
    """Make `exp` the store's session `exp.session_id` (replacing any older copy), its stored chunks
    on the device. Returns the tokens whose KV was imported."""
    return _when_idle(lambda: store.import_session(exp), timeout)
