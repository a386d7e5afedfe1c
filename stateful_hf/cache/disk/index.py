"""The disk tier's index: an SQLite database (`index.sqlite`) that names what the data files hold.

Tables:
  meta(key, value)        header: format version, KV geometry, model fingerprint, and per data file
                          ("kv", "hidden") its file name, slot count (and the hidden split)
  sessions(id, token_ids, tenant, cache_salt, retained)
                          each session's token ids (int64 little-endian), up to the end of its last
                          chunk on disk: what its chunks' identity tags are computed from; its prefix
                          sharing scope (`PrefixScope`: tenant NULL when it has none yet); whether it
                          is a retained prefix holder (`KVStore.delete(keep_shared=True)`)
  chunks(session, k, form, slot, checksum)
                          chunk k of the session is in `slot` of the `form` file, with the xxh3-64
                          `checksum` of its identity tag and its bytes (`DiskFile.checksum`, `disk/file.py`).
                          Several rows name one slot when sessions share the chunk (prefix sharing):
                          same k, same checksum (the identity tag chains the prefix's ids)

Format 3 added the sessions' scope and retained columns. A format-2 index (without them) is upgraded
in place at open, in one transaction with its header (its sessions get no scope: their chunks are
not indexed for sharing after the restart until a turn registers them again); other formats are
refused by the tier (`disk/tier.py`).

Journal WAL, synchronous=FULL: `commit` returns once the transaction is durable, and a crash leaves
the last committed transaction whole. Every commit is one transaction holding one whole state of
the store (the difference from the last committed state is written), so the index on disk never
shows half a move. SQLite does transactions and durability; this module only maps rows to values.
"""

from __future__ import annotations

import sqlite3
from array import array
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from ..errors import StoreError

FORMAT = "stateful-hf disk tier 3"
UPGRADABLE = "stateful-hf disk tier 2"     # the same but for the sessions' scope and retained columns
FORMS = ("kv", "hidden")
Row = tuple[str, int, int]          # (form, slot, checksum) of one chunk
SessionRow = tuple[bytes, str | None, str | None, bool]   # (packed token ids, tenant, cache_salt, retained)


def durability_point(name: str) -> None:
    """Called at each step whose order matters for crash consistency ("data-flush", "index-commit",
    "relocate-copied", "relocate-committed", ...). Does nothing; tests replace it to inject a failure
    (raise OSError) or a crash (kill the process) exactly there."""


def pack_ids(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    out = array("q")
    out.frombytes(blob)
    return out.tolist()


class DiskIndex:
    """The open index of one disk directory. `meta`, `sessions` and `rows` are the last committed
    state (as loaded at open, then as committed)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"disk tier index {str(path)!r} cannot be opened: {e}") from e
        try:
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self.conn.execute("CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, token_ids BLOB NOT NULL, "
                              "tenant TEXT, cache_salt TEXT, retained INTEGER NOT NULL DEFAULT 0)")
            self.conn.execute("CREATE TABLE IF NOT EXISTS chunks (session TEXT NOT NULL, k INTEGER NOT NULL, "
                              "form TEXT NOT NULL, slot INTEGER NOT NULL, checksum INTEGER NOT NULL, "
                              "PRIMARY KEY (session, k))")
            self.meta = dict(self.conn.execute("SELECT key, value FROM meta"))
            if self.meta.get("format") == UPGRADABLE:
                self._upgrade()
            self.sessions: dict[str, SessionRow] = {}
            for sid, blob, tenant, salt, retained in self.conn.execute(
                    "SELECT id, token_ids, tenant, cache_salt, retained FROM sessions"):
                self.sessions[sid] = (bytes(blob), tenant if isinstance(tenant, str) else None,
                                      salt if isinstance(salt, str) else None, bool(retained))
            self.rows: dict[tuple[str, int], Row] = {}
            for sid, k, form, slot, checksum in self.conn.execute("SELECT * FROM chunks"):
                if isinstance(k, int) and form in FORMS and isinstance(slot, int) and isinstance(checksum, int):
                    self.rows[sid, k] = (form, slot, checksum)       # malformed rows are left out: recomputed
            self.ks = _ks(self.rows)          # per session, the k of its rows (what `commit_changes` replaces)
        except (sqlite3.Error, TypeError, ValueError) as e:
            self.conn.close()
            raise StoreError(f"disk tier index {str(path)!r} is unreadable: {e}") from e

    def _upgrade(self) -> None:
        """Format 2 -> 3: the sessions' new columns and the header's format, in one transaction."""
        with self._transaction() as c:
            have = {row[1] for row in c.execute("PRAGMA table_info(sessions)")}
            for column in ("tenant TEXT", "cache_salt TEXT", "retained INTEGER NOT NULL DEFAULT 0"):
                if column.split()[0] not in have:
                    c.execute(f"ALTER TABLE sessions ADD COLUMN {column}")
            c.execute("UPDATE meta SET value = ? WHERE key = 'format'", (FORMAT,))
        self.meta["format"] = FORMAT

    @contextmanager
    def _transaction(self, point: str | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends (after the durability point `point`, if
        any), rolled back and re-raised when it raises."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            yield c
            if point is not None:
                durability_point(point)
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    def commit(self, meta: Mapping[str, str], sessions: Mapping[str, SessionRow],
               rows: Mapping[tuple[str, int], Row]) -> None:
        """Make (meta, sessions, rows) the durable state in one transaction. Raises OSError or
        sqlite3.Error with nothing changed (on disk or in this object) when it cannot."""
        with self._transaction("index-commit") as c:
            for key, value in meta.items():
                if self.meta.get(key) != value:
                    c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            c.executemany("DELETE FROM sessions WHERE id = ?", [(s,) for s in self.sessions if s not in sessions])
            c.executemany("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)",
                          [(s, *row) for s, row in sessions.items() if self.sessions.get(s) != row])
            c.executemany("DELETE FROM chunks WHERE session = ? AND k = ?",
                          [key for key in self.rows if key not in rows])
            c.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?)",
                          [(*key, *row) for key, row in rows.items() if self.rows.get(key) != row])
        self.meta = {**self.meta, **meta}
        self.sessions, self.rows = dict(sessions), dict(rows)
        self.ks = _ks(self.rows)

    def commit_changes(self, changes: Mapping[str, tuple[SessionRow | None, Mapping[int, Row]]]) -> None:
        """`commit`, for the sessions in `changes` only: each one's row (None: it has none) and its chunk
        rows by k replace what the index holds of it; O(the changed sessions' rows). Raises as `commit`."""
        with self._transaction("index-commit") as c:
            for sid, (row, rows) in changes.items():
                old = self.ks.get(sid, ())
                if row is None and sid in self.sessions:
                    c.execute("DELETE FROM sessions WHERE id = ?", (sid,))
                elif row is not None and self.sessions.get(sid) != row:
                    c.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)", (sid, *row))
                c.executemany("DELETE FROM chunks WHERE session = ? AND k = ?",
                              [(sid, k) for k in old if k not in rows])
                c.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?)",
                              [(sid, k, *r) for k, r in rows.items() if self.rows.get((sid, k)) != r])
        for sid, (row, rows) in changes.items():
            if row is None:
                self.sessions.pop(sid, None)
            else:
                self.sessions[sid] = row
            for k in self.ks.pop(sid, ()):
                del self.rows[sid, k]
            self.rows.update(((sid, k), r) for k, r in rows.items())
            if rows:
                self.ks[sid] = set(rows)

    def close(self) -> None:
        self.conn.close()


def _ks(rows: Mapping[tuple[str, int], Row]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for sid, k in rows:
        out.setdefault(sid, set()).add(k)
    return out


def read_meta(directory: Path) -> tuple[dict[str, str], int]:
    """The header of the index in `directory` and how many hidden chunks it names, read without
    opening the tier (({}, 0) if there is none or it is unreadable)."""
    path = directory / "index.sqlite"
    if not path.is_file():
        return {}, 0
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(conn.execute("SELECT key, value FROM meta"))
            return meta, conn.execute("SELECT COUNT(*) FROM chunks WHERE form = 'hidden'").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return {}, 0
