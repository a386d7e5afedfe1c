"""The session table: every session of a store by id, the store lock, and leases.

Owns: the `{session id: Session}` map, the store's one re-entrant lock and the clock sessions'
activity is measured with. Mutates only the map (`open`, `add`, `remove`) and a session's lease
fields (`busy`, `turn_started`, `last_active` in `acquire`/`release`). A session's token ids and
chunks are changed by the other parts (`kv_store.py` lists who may change what), always with
`lock` held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from .errors import SessionBusyError, UnknownSessionError
from .session import Session


class SessionTable:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.lock = threading.RLock()          # every store method that reads or changes sessions holds it
        self._sessions: dict[str, Session] = {}

    def get(self, session_id: str) -> Session:
        """The session; UnknownSessionError if there is none."""
        try:
            return self._sessions[session_id]
        except KeyError:
            raise UnknownSessionError(session_id) from None

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        """The session, created empty if new. Mutates: the map."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session id must be a non-empty string, got {session_id!r}")
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = Session(session_id, last_active=self.clock())
        return s

    def add(self, s: Session) -> None:
        """Put a session made elsewhere (the disk index's, at startup). Mutates: the map."""
        self._sessions[s.session_id] = s

    def remove(self, session_id: str) -> None:
        """Forget a session (its chunks must have been released). Mutates: the map."""
        del self._sessions[session_id]

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def ids(self) -> list[str]:
        return list(self._sessions)

    def acquire(self, session_id: str) -> tuple[Session, float | None]:
        """Lease the session for one turn: it becomes busy. Returns it and, when it has history (a
        returning conversation), the idle gap since its last activity. SessionBusyError if leased.
        Mutates: `busy`, `turn_started`."""
        s = self.get(session_id)
        if s.busy:
            raise SessionBusyError(session_id)
        gap = self.clock() - s.last_active if s.token_ids else None
        s.busy = s.turn_started = True
        return s, gap

    def release(self, s: Session) -> None:
        """End a lease. Mutates: `busy`, `turn_started`, `in_turn`, `last_active`."""
        s.busy = s.turn_started = s.in_turn = False
        s.last_active = self.clock()

    def touch(self, s: Session, now: float) -> None:
        """The session was active at `now` (a step committed). Mutates: `last_active`."""
        s.last_active = now
