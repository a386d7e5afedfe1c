"""`ThrowawaySessions`: sessions the engine opens for turns without a session id, and deletes after.

Owns: the set of throwaway session keys whose turns have not all ended. It may mutate that set and
the store (it deletes a throwaway session, `keep_shared=True`, when the registry reports that the
session's last turn has ended: `forget`, the registry's `on_idle`). Both methods run under the
engine's condition (`new` takes it; `forget` is called with it held). Steps hold the store lock only
inside the step lock, so deleting here cannot deadlock.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

from ..cache.doors.engine import DEFAULT_TENANT, EngineStore, UnknownSessionError, session_key


class ThrowawaySessions:
    """Throwaway session keys of `store`, guarded by `condition` (the engine's)."""

    def __init__(self, store: EngineStore, condition: threading.Condition):
        self.store, self.condition = store, condition
        self.keys: set[str] = set()          # minted, not yet deleted

    def new(self, tenant: str | None = None) -> str:
        """A fresh session key of `tenant` (default: the default tenant), in no store and not minted before."""
        with self.condition:
            while True:
                key = session_key(tenant or DEFAULT_TENANT, f"~{uuid.uuid4().hex}")
                if key not in self.keys and key not in self.store:
                    self.keys.add(key)
                    return key

    def forget(self, session_id: str) -> None:
        """The registry's on_idle (condition held): delete `session_id` if it is a throwaway session
        (its shared prefix stays findable); a named session is left alone."""
        if session_id in self.keys:
            self.keys.discard(session_id)
            with contextlib.suppress(UnknownSessionError):      # refused before its session was opened
                self.store.delete(session_id, keep_shared=True)
