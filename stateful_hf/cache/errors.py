"""Errors of the session store. Each leaves the store as it was (check_integrity() holds)."""


class StoreError(Exception):
    """Base of every error the store raises."""


class UnknownSessionError(StoreError, KeyError):
    def __init__(self, session_id: str):
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"unknown session {self.session_id!r}"


class SessionBusyError(StoreError, RuntimeError):
    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} is busy with another turn; wait for it or use another session")
        self.session_id = session_id


class CapacityError(StoreError, MemoryError):
    """A request needs more device blocks than can be freed for it."""
