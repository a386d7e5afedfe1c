"""The router's session -> replica directory (`SessionDirectory`): where each session's KV is held.

A dict in memory serves every read; with a path, every change is also written to SQLite (one row per
session, WAL journal), so that a restarted router finds each session's replica without asking every
replica about it (`Router._locate`, a fan-out per unknown session). A row naming a replica the router
no longer has (fewer replicas after the restart) is ignored. Not shared between routers: one writer
per file. Writes are one statement each, autocommitted; a crash loses at most the last one, and a
wrong or missing row costs one `_locate` or one migration, never a wrong answer (the replica that
serves a turn always checks the session's history itself).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, MutableMapping
from pathlib import Path


class SessionDirectory(MutableMapping[str, int]):
    """session key -> replica index; persistent when given a path."""

    def __init__(self, path: str | Path | None = None, replicas: int | None = None):
        self._map: dict[str, int] = {}
        self._db: sqlite3.Connection | None = None
        if path is None:
            return
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS directory (session TEXT PRIMARY KEY, replica INTEGER NOT NULL)")
        for sid, replica in self._db.execute("SELECT session, replica FROM directory"):
            if replicas is None or 0 <= replica < replicas:
                self._map[sid] = replica

    def __getitem__(self, sid: str) -> int:
        return self._map[sid]

    def __setitem__(self, sid: str, replica: int) -> None:
        if self._map.get(sid) == replica:
            return
        self._map[sid] = replica
        if self._db is not None:
            self._db.execute("INSERT OR REPLACE INTO directory (session, replica) VALUES (?, ?)", (sid, replica))

    def __delitem__(self, sid: str) -> None:
        del self._map[sid]
        if self._db is not None:
            self._db.execute("DELETE FROM directory WHERE session = ?", (sid,))

    def __contains__(self, sid: object) -> bool:
        return sid in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def get(self, sid: str, default=None):
        return self._map.get(sid, default)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
