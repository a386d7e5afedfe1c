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
    """The open index of one disk directory. `meta` is the last committed header. Of the sessions and
    chunk rows only a digest per session is kept in memory (`digests`: what a commit compares with, so
    that it writes only what changed); `read` reads them back."""

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
            self._opened = self._query()       # what `read` gives until the first commit (the store loads it)
        except (sqlite3.Error, TypeError, ValueError) as e:
            self.conn.close()
            raise StoreError(f"disk tier index {str(path)!r} is unreadable: {e}") from e
        sessions, rows = self._opened
        by_session = _by_session(rows)
        # per session with a row or chunk rows: the digest of its row and chunk rows as committed
        self.digests: dict[str, int] = {
            sid: _digest(sessions.get(sid), by_session.get(sid, {})) for sid in sessions.keys() | by_session.keys()}

    def _query(self) -> tuple[dict[str, SessionRow], dict[tuple[str, int], Row]]:
        sessions: dict[str, SessionRow] = {}
        for sid, blob, tenant, salt, retained in self.conn.execute(
                "SELECT id, token_ids, tenant, cache_salt, retained FROM sessions"):
            sessions[sid] = (bytes(blob), tenant if isinstance(tenant, str) else None,
                             salt if isinstance(salt, str) else None, bool(retained))
        rows: dict[tuple[str, int], Row] = {}
        for sid, k, form, slot, checksum in self.conn.execute("SELECT * FROM chunks"):
            if isinstance(k, int) and form in FORMS and isinstance(slot, int) and isinstance(checksum, int):
                rows[sid, k] = (form, slot, checksum)       # malformed rows are left out: recomputed
        return sessions, rows

    def read(self) -> tuple[dict[str, SessionRow], dict[tuple[str, int], Row]]:
        """The committed sessions and chunk rows (malformed rows left out): read from the database, or
        the read made at open until something is committed."""
        return self._opened if self._opened is not None else self._query()

    def forget_opened(self) -> None:
        """The store has loaded what `read` gave at open: later reads query the database."""
        self._opened = None

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
        by_session = _by_session(rows)
        changes = {sid: (sessions.get(sid), by_session.get(sid, {}))
                   for sid in self.digests.keys() | sessions.keys() | by_session.keys()}
        meta = {key: value for key, value in meta.items() if self.meta.get(key) != value}
        self._write(meta, changes, force=True)

    def commit_changes(self, changes: Mapping[str, tuple[SessionRow | None, Mapping[int, Row]]]) -> None:
        """`commit`, for the sessions in `changes` only: each one's row (None: it has none) and its chunk
        rows by k replace what the index holds of it; O(the changed sessions' rows). Nothing differs from
        what is committed: no transaction. Raises as `commit`."""
        self._write({}, changes, force=False)

    def _write(self, meta: Mapping[str, str], changes: Mapping[str, tuple[SessionRow | None, Mapping[int, Row]]],
               force: bool) -> None:
        todo = {}                              # sid -> (row, rows, digests): those that differ
        for sid, (row, rows) in changes.items():
            d, old = _digest(row, rows), self.digests.get(sid, _NONE)
            if d != old:
                todo[sid] = (row, rows, d, old)
        if not (todo or meta or force):
            return
        with self._transaction("index-commit") as c:
            for key, value in meta.items():
                c.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            for sid, (row, rows, d, old) in todo.items():
                if d >> 64 != old >> 64:           # its row
                    if row is None:
                        c.execute("DELETE FROM sessions WHERE id = ?", (sid,))
                    else:
                        c.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)", (sid, *row))
                if (d ^ old) & _MASK:              # its chunk rows
                    c.execute("DELETE FROM chunks WHERE session = ?", (sid,))
                    c.executemany("INSERT INTO chunks VALUES (?, ?, ?, ?, ?)", [(sid, k, *r) for k, r in rows.items()])
        self.meta = {**self.meta, **meta}
        self._opened = None
        for sid, (_, _, d, _) in todo.items():
            if d == _NONE:
                self.digests.pop(sid, None)
            else:
                self.digests[sid] = d

    def close(self) -> None:
        self.conn.close()


_MASK = (1 << 64) - 1


def _digest(row: SessionRow | None, rows: Mapping[int, Row]) -> int:
    """The hash of a session's row (high 64 bits) and of its chunk rows (low 64 bits), as one int (one
    object a session): equal digests, equal rows (in this process)."""
    return (hash(row) & _MASK) << 64 | hash(tuple(sorted(rows.items()))) & _MASK


_NONE = _digest(None, {})      # a session the index holds nothing of


def _by_session(rows: Mapping[tuple[str, int], Row]) -> dict[str, dict[int, Row]]:
    out: dict[str, dict[int, Row]] = {}
    for (sid, k), r in rows.items():
        out.setdefault(sid, {})[k] = r
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
