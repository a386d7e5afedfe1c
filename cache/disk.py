"""The disk tier: data files of chunk slots plus an SQLite index, crash-consistent and checked.

The rule: a chunk is served from disk only if the store can prove it is the chunk it names;
otherwise it is recomputed from its token ids. The proof is (1) a header checked at open (format,
KV geometry, chunk size, dtype, slot counts, and a fingerprint of the model's config and weights,
given by the caller), and (2) a checksum per chunk (`DiskFile.checksum`: xxh3-64 of its identity
tag, which chains the token ids of its prefix, and of its bytes), verified before the chunk is first
read after the tier opened (a chunk written by this process is checksummed as it is written). A
chunk that fails it is dropped and recomputed (`disk_checksum_failures`).

Why SQLite for the index: transactions and durability are its job (WAL, synchronous=FULL), so one
commit switches the whole disk state atomically, with no hand-written rename/fsync protocol; a
diff of rows is written per change instead of the whole index. Why xxh3-64: the fastest well-kept
64-bit hash here (`xxhash`), 64 bits so a wrong chunk passing by chance is negligible.

Layout of `disk_dir`: `index.sqlite` (`disk_index.py`), `kv.<gen>.bin` (the KV pool's tensor,
layer-major), `hidden.<gen>.bin` (with hidden states in use: hidden layers then K/V layers of
HCache chunks), `lock` (one store per directory). `<gen>` grows when a file is replaced.

Crash ordering (every step below is durable before the next starts):
  1. a chunk moving to disk is written into a slot that the durable index does not name (the free
     list never holds a slot the last committed index names), and the file is fdatasync'ed
     (`write_done`); only then does the chunk count as on disk;
  2. the index transaction naming it commits after that (`commit`);
  3. a slot freed from disk waits in `limbo` until an index that no longer names it has committed;
     only then does it rejoin the free list and can be written again.
A chunk shared by several sessions (prefix sharing) is one slot named by a row of each holder (same
chunk index, same checksum: the identity tag chains the prefix's ids, equal for all holders). The
store frees the slot only when its last holder lets go, so it enters limbo only once no row of the
current state names it, and leaves limbo only once the committed index names it no more (rule 3).
So at any crash the durable index names only slots holding exactly the data it names.
Relocation (a different `disk_capacity` at open): the chunks are copied into a new file of the new
size, which is flushed, then one index transaction switches to it, then the old file is deleted
(files not named by the index are leftovers of a crash and are deleted at open).

The disk is a cache: a failed flush or commit (EIO, ENOSPC, a full SQLite) never fails a turn.
The tier marks itself `degraded` (`failing` names the step), counts `write_failures`, and new
moves to disk retry the failed step first (if it fails again they drop instead); chunks whose data
could not be flushed stay where they were or are dropped (the caller's choice), and the last
committed index stays true throughout (limbo slots are not reused until a commit succeeds).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from . import disk_index
from .disk_file import DiskFile
from .disk_index import FORMAT, DiskIndex, SessionRow, read_meta, unpack_ids
from .disk_pool import DiskHiddenPool, DiskPool, Quarantined
from .errors import StoreError
from .hidden_states import HiddenSpec
from .spec import KVSpec

_DATA_FILE = re.compile(r"(kv|hidden)\.\d+\.bin")


@dataclass(frozen=True, slots=True)
class SavedSession:
    """One session of the committed index: its token ids (up to its last disk chunk), its sharing
    scope (tenant None: none recorded), whether it was a retained prefix holder, and
    {chunk k: (form, slot, checksum)} of its chunks on disk."""

    token_ids: list[int]
    tenant: str | None
    cache_salt: str | None
    retained: bool
    chunks: dict[int, tuple[str, int, int]]


def _geometry(spec: KVSpec) -> dict:
    return {"num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "block_size": spec.block_size, "dtype": str(spec.dtype).removeprefix("torch.")}


class DiskTier:
    """Opens (or creates) the tier in `directory` for `spec` and the model `fingerprint`, with
    `num_blocks` KV slots (relocating if the saved file has another size). Raises StoreError,
    leaving nothing behind that it created, when the directory cannot be used."""

    def __init__(self, spec: KVSpec, directory: str | os.PathLike, num_blocks: int, fingerprint: str = ""):
        self.dir, self.spec, self.fingerprint = Path(directory), spec, fingerprint
        self.failing: set[str] = set()          # durability steps whose last try failed: "flush", "commit"
        self.write_failures, self.checksum_failures = 0, 0
        self.files: dict[str, DiskFile] = {}
        self.hidden_pool: DiskHiddenPool | None = None
        self.index: DiskIndex | None = None
        self._lock_file, self._locked = None, False
        created = self._make_dir()
        fresh = not (self.dir / "index.sqlite").exists()
        try:
            self._lock()
            if fresh and (self.dir / "index.json").exists():
                raise StoreError(f"disk tier {str(self.dir)!r} holds a tier of an older format (index.json); "
                                 "use another disk_dir or delete it")
            self.index = DiskIndex(self.dir / "index.sqlite")
            self._check_header()
            kv = self._open_file("kv", self._kv_shapes, num_blocks, {})
        except BaseException:
            locked = self._locked
            self.close()
            if fresh and locked:          # what this call created, never another store's files
                for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "lock"):
                    (self.dir / name).unlink(missing_ok=True)
                for d in reversed(created):
                    with contextlib.suppress(OSError):
                        d.rmdir()
            raise
        self.pool = DiskPool(spec, kv.slots, data=kv.parts[0])
        self._remove_leftovers()

    # ---- opening ----------------------------------------------------------------------------------

    def _make_dir(self) -> list[Path]:
        if self.dir.exists() and not self.dir.is_dir():
            raise StoreError(f"disk tier directory {str(self.dir)!r} is not writable: it is a file, not a directory")
        created = [p for p in [self.dir, *self.dir.parents] if not p.exists()][::-1]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write-probe"
            probe.touch()
            probe.unlink()
        except OSError as e:
            for d in reversed(created):
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise StoreError(f"disk tier directory {str(self.dir)!r} is not writable: {e}") from e
        return created

    def _lock(self) -> None:
        try:
            self._lock_file = open(self.dir / "lock", "a+")   # noqa: SIM115 (held for the store's life)
        except OSError as e:
            raise StoreError(f"disk tier directory {str(self.dir)!r} is not writable: {e}") from e
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self._lock_file.close()
            self._lock_file = None
            raise StoreError(f"disk tier {str(self.dir)!r} is in use by another store") from e
        self._locked = True

    def _check_header(self) -> None:
        meta, where = self.index.meta, repr(str(self.dir))
        header = {"format": FORMAT, "geometry": json.dumps(_geometry(self.spec), sort_keys=True),
                  "model": self.fingerprint}
        if "format" not in meta and not self.index.rows:       # never finished creating: a new tier
            try:
                self.index.commit(header, {}, {})
            except (OSError, sqlite3.Error) as e:
                raise StoreError(f"cannot create the disk tier index in {where}: {e}") from e
            return
        if meta.get("format") != FORMAT:
            raise StoreError(f"disk tier {where} holds format {meta.get('format')!r}, this version reads "
                             f"{FORMAT!r}; use another disk_dir")
        try:
            saved = json.loads(meta["geometry"])
        except (KeyError, ValueError) as e:
            raise StoreError(f"disk tier {where}: its index header is damaged ({e!r}); use another disk_dir") from e
        if saved != _geometry(self.spec):
            raise StoreError(f"disk tier {where} holds KV of another geometry {saved}, this model needs "
                             f"{_geometry(self.spec)}; use another disk_dir")
        if meta.get("model") != self.fingerprint:
            raise StoreError(f"disk tier {where} was made for another model (fingerprint {meta.get('model')!r}, "
                             f"this one is {self.fingerprint!r}): its KV would be wrong here; use another disk_dir")

    def _kv_shapes(self, n: int) -> list[tuple[int, ...]]:
        s = self.spec
        return [(s.num_layers, n, 2, s.block_size, s.num_kv_heads, s.head_dim)]

    def _open_file(self, form: str, shapes_of, slots: int, extra: dict[str, str]) -> DiskFile:
        """The data file of `form` with `slots` slots: the saved one if it matches, relocated if only
        its slot count differs, else a new one (the index then forgets that form's chunks)."""
        meta = self.index.meta
        name = meta.get(f"{form}.file")
        if name is not None and _DATA_FILE.fullmatch(name) and all(meta.get(k) == v for k, v in extra.items()):
            try:
                old_slots = int(meta[f"{form}.slots"])
            except (KeyError, ValueError) as e:
                raise StoreError(f"disk tier {str(self.dir)!r}: its index header is damaged ({e!r})") from e
            old = DiskFile(self.dir / name, shapes_of(old_slots), self.spec.dtype, create=False)
            if old_slots == slots:
                self.files[form] = old
                return old
            return self._relocate(form, old, shapes_of, slots, extra)
        new = self._new_file(form, shapes_of(slots))
        rows = {key: r for key, r in self.index.rows.items() if r[0] != form}
        self._switch(form, new, extra, rows, old=self.dir / name if name and _DATA_FILE.fullmatch(name) else None)
        return new

    def _new_file(self, form: str, shapes) -> DiskFile:
        gen = int(self.index.meta.get("generation", "0")) + 1
        return DiskFile(self.dir / f"{form}.{gen}.bin", shapes, self.spec.dtype, create=True)

    def _switch(self, form: str, new: DiskFile, extra: dict[str, str], rows: dict, old: Path | None) -> None:
        """Make `new` the file of `form` in one index transaction (it is flushed first), then delete `old`."""
        try:
            new.flush()
            _fsync_dir(self.dir)
            disk_index.durability_point("relocate-copied")
            gen = new.path.name.split(".")[1]
            self.index.commit({f"{form}.file": new.path.name, f"{form}.slots": str(new.slots), "generation": gen,
                               **extra}, self.index.sessions, rows)
        except (OSError, sqlite3.Error) as e:
            new.close()
            new.path.unlink(missing_ok=True)
            raise StoreError(f"cannot set up the disk tier file {str(new.path)!r}: {e}") from e
        disk_index.durability_point("relocate-committed")
        self.files[form] = new
        if old is not None and old != new.path:
            old.unlink(missing_ok=True)

    def _relocate(self, form: str, old: DiskFile, shapes_of, slots: int, extra: dict[str, str]) -> DiskFile:
        """Copy the chunks of `form` into a new file of `slots` slots, each old slot once (rows of
        sessions sharing a chunk name one slot: they name one new slot). When they do not all fit,
        the ones of lowest value go: the lowest chunk indices (Cost(l) of recomputing grows with the
        position; the index keeps no idle times)."""
        named: dict[int, int] = {}                 # old slot -> its highest chunk index
        for (_, k), r in self.index.rows.items():
            if r[0] == form and 0 <= r[1] < old.slots:
                named[r[1]] = max(named.get(r[1], k), k)
        keep = sorted(named, key=lambda slot: (-named[slot], slot))[:slots]
        new_slot = {slot: i for i, slot in enumerate(keep)}
        try:
            new = self._new_file(form, shapes_of(slots))
        except StoreError:
            old.close()
            raise
        new.copy_from(old, keep, list(range(len(keep))))
        rows = {key: r for key, r in self.index.rows.items() if r[0] != form}
        rows.update({key: (form, new_slot[r[1]], r[2]) for key, r in self.index.rows.items()
                     if r[0] == form and r[1] in new_slot})
        old.close()
        self._switch(form, new, extra, rows, old=old.path)
        return new

    def _remove_leftovers(self) -> None:
        named = {self.index.meta.get("kv.file"), self.index.meta.get("hidden.file")}
        for p in self.dir.iterdir():
            if _DATA_FILE.fullmatch(p.name) and p.name not in named:
                p.unlink(missing_ok=True)

    def open_hidden(self, spec: HiddenSpec, num_blocks: int) -> bool:
        """Map the hidden file: slots of hidden chunks of `spec`'s split (`self.hidden_pool`). Returns
        True when the index's hidden chunks were saved in this same split (so they are usable);
        otherwise a new file replaces it and those chunks are forgotten (recomputed)."""
        kv, bs = spec.kv, spec.kv.block_size
        geometry = json.dumps({"hidden_size": spec.hidden_size, "hidden_layers": spec.hidden_layers}, sort_keys=True)
        same = self.index.meta.get("hidden.geometry") == geometry

        def shapes(n):
            return [(spec.hidden_layers, n, bs, spec.hidden_size),
                    (spec.kv_layers, n, 2, bs, kv.num_kv_heads, kv.head_dim)]

        f = self._open_file("hidden", shapes, num_blocks, {"hidden.geometry": geometry})
        self.hidden_pool = DiskHiddenPool(spec, f.slots, data=(f.parts[0], f.parts[1]))
        self._remove_leftovers()
        return same

    def saved_sessions(self) -> dict[str, SavedSession]:
        """The sessions of the last committed index. Rows of a form whose file is not open, or naming
        a slot out of range, are left out."""
        out = {sid: SavedSession(unpack_ids(blob), tenant, salt, retained, {})
               for sid, (blob, tenant, salt, retained) in self.index.sessions.items()}
        for (sid, k), (form, slot, checksum) in self.index.rows.items():
            pool = self.pool_of(form)
            if sid in out and pool is not None and 0 <= slot < pool.num_blocks:
                out[sid].chunks[k] = (form, slot, checksum)
        return out

    def pool_of(self, form: str) -> Quarantined | None:
        return self.pool if form == "kv" else self.hidden_pool

    # ---- running ------------------------------------------------------------------------------------

    def write_done(self, form: str, slots: list[int], tags: list[bytes]) -> bool:
        """After chunks were written into `slots` of `form`: flush the file, then record their
        checksums. False (the slots freed, the tier degraded) when the flush fails."""
        pool, f = self.pool_of(form), self.files[form]
        try:
            f.flush()
        except OSError:
            self._failed("flush")
            pool.free_unnamed(slots)
            return False
        self.failing.discard("flush")
        for slot, tag in zip(slots, tags):
            pool.checksums[slot] = f.checksum(tag, slot)
            pool.verified.add(slot)
        return True

    def verify(self, form: str, slot: int, tag: bytes) -> bool:
        """Whether the slot holds the chunk whose identity tag is `tag` (checked once per write/open)."""
        pool, f = self.pool_of(form), self.files[form]
        if slot in pool.verified:
            return True
        if pool.checksums.get(slot) == f.checksum(tag, slot):
            pool.verified.add(slot)
            return True
        self.checksum_failures += 1
        return False

    def retag(self, form: str, slot: int, old: bytes, new: bytes) -> bool:
        """The chunk in `slot` now stands for a shorter prefix (its history was cut inside it):
        verify it under its old tag, then checksum it under the new one. False if it fails."""
        if not self.verify(form, slot, old):
            return False
        self.pool_of(form).checksums[slot] = self.files[form].checksum(new, slot)
        return True

    def commit(self, sessions: dict[str, SessionRow], rows: dict[tuple[str, int], tuple[str, int, int]]) -> bool:
        """Make this the durable index; then slots in limbo are free. False (degraded) if it fails."""
        try:
            self.index.commit({}, sessions, rows)
        except (OSError, sqlite3.Error):
            self._failed("commit")
            return False
        self.failing.discard("commit")
        for pool in (self.pool, self.hidden_pool):
            if pool is not None:
                pool.release_limbo()
        return True

    def _failed(self, step: str) -> None:
        self.failing.add(step)
        self.write_failures += 1

    @property
    def degraded(self) -> bool:
        """A durability step failed last time it was tried: new moves to disk retry it first."""
        return bool(self.failing)

    def retry_flush(self) -> bool:
        """Try the data files' flush again (before writing while degraded)."""
        if "flush" not in self.failing:
            return True
        try:
            for f in self.files.values():
                f.flush()
        except OSError:
            self._failed("flush")
            return False
        self.failing.discard("flush")
        return True

    def drop_page_cache(self) -> bool:
        """Write the tier's files back and evict them from the OS page cache, so the next reads come
        from the device (for profiling and benchmarks). Returns False where mapped pages cannot be
        unmapped (reads of them may then stay warm)."""
        return all([f.drop_page_cache() for f in self.files.values()])

    def close(self) -> None:
        """Unmap the data files (every view of them goes now, not at garbage collection), close the
        index and release the directory's lock. The tier cannot be used afterwards."""
        for pool in (getattr(self, "pool", None), self.hidden_pool):
            if pool is not None:
                pool.unmap()
        for f in self.files.values():
            f.close()
        if self.index is not None:
            self.index.close()
            self.index = None
        if self._lock_file is not None and not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
        self._locked = False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_hidden_layers(directory: str | os.PathLike) -> int | None:
    """The hidden split (layers kept as hidden states) recorded in the index of `directory`, if
    any: a restarted store that keeps this split can use its hidden chunks."""
    meta, hidden_chunks = read_meta(Path(directory))
    geometry = meta.get("hidden.geometry")
    if not hidden_chunks:
        return None
    try:
        return int(json.loads(geometry)["hidden_layers"]) if geometry else None
    except (ValueError, KeyError, TypeError):
        return None
