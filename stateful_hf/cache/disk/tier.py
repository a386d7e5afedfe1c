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

Layout of `disk_dir`: `index.sqlite` (`disk/index.py`), `kv.<gen>.bin` (the KV pool's tensor,
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
Opening (the directory, its lock, the header check, which data file is current, relocation to
another `disk_capacity`) is `disk/directory.py`'s `DiskDirectory`; this module runs the open tier.

The disk is a cache: a failed flush or commit (EIO, ENOSPC, a full SQLite) never fails a turn.
The tier marks itself `degraded` (`failing` names the step), counts `write_failures`, and new
moves to disk retry the failed step first (if it fails again they drop instead); chunks whose data
could not be flushed stay where they were or are dropped (the caller's choice), and the last
committed index stays true throughout (limbo slots are not reused until a commit succeeds).
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass

from ..hidden.states import HiddenSpec
from ..pools.tier import LazyFree
from ..spec import KVSpec
from .directory import DiskDirectory
from .file import DiskFile
from .index import SessionRow, unpack_ids
from .pool import DiskHiddenPool, DiskPool, Quarantined


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


class DiskTier:
    """Opens (or creates) the tier in `directory` for `spec` and the model `fingerprint`, with
    `num_blocks` KV slots (`DiskDirectory`: relocating if the saved file has another size). Raises
    StoreError, leaving nothing behind that it created, when the directory cannot be used. Its pools
    free through `transfer` (the store's; None outside a store).

    Mutates: its pools' free lists, limbo, checksums and proofs (`write_done`, `verify`, `retag`,
    `commit`), the index's rows (`commit`), its failure state (`failing`, the counters)."""

    def __init__(self, spec: KVSpec, directory: str | os.PathLike, num_blocks: int, fingerprint: str = "",
                 transfer: LazyFree | None = None):
        self.directory = DiskDirectory(spec, directory, num_blocks, fingerprint)
        self.dir, self.spec, self.transfer = self.directory.path, spec, transfer
        self.files: dict[str, DiskFile] = self.directory.files     # read-only here: the directory's
        self.failing: set[str] = set()          # durability steps whose last try failed: "flush", "commit"
        self.write_failures, self.checksum_failures = 0, 0
        self.hidden_pool: DiskHiddenPool | None = None
        kv = self.directory.kv
        self.pool = DiskPool(spec, kv.slots, data=kv.parts[0], transfer=transfer, file=kv)
        self.directory.remove_leftovers()

    def open_hidden(self, spec: HiddenSpec, num_blocks: int) -> bool:
        """Map the hidden file: slots of hidden chunks of `spec`'s split (`self.hidden_pool`). Returns
        True when the index's hidden chunks were saved in this same split (so they are usable);
        otherwise a new file replaces it and those chunks are forgotten (recomputed)."""
        kv, bs = spec.kv, spec.kv.block_size
        geometry = json.dumps({"hidden_size": spec.hidden_size, "hidden_layers": spec.hidden_layers}, sort_keys=True)
        same = self.directory.index.meta.get("hidden.geometry") == geometry

        def shapes(n):
            return [(spec.hidden_layers, n, bs, spec.hidden_size),
                    (spec.kv_layers, n, 2, bs, kv.num_kv_heads, kv.head_dim)]

        f = self.directory.open_file("hidden", shapes, num_blocks, {"hidden.geometry": geometry})
        self.hidden_pool = DiskHiddenPool(spec, f.slots, data=(f.parts[0], f.parts[1]), transfer=self.transfer,
                                          file=f)
        self.directory.remove_leftovers()
        return same

    def saved_sessions(self) -> tuple[dict[str, SavedSession], int, int]:
        """The sessions of the last committed index, and how many session rows and chunk rows it has.
        Rows of a form whose file is not open, or naming a slot out of range, are left out."""
        sessions, rows = self.directory.index.read()
        out = {sid: SavedSession(unpack_ids(blob), tenant, salt, retained, {})
               for sid, (blob, tenant, salt, retained) in sessions.items()}
        for (sid, k), (form, slot, checksum) in rows.items():
            pool = self.pool_of(form)
            if sid in out and pool is not None and 0 <= slot < pool.num_blocks:
                out[sid].chunks[k] = (form, slot, checksum)
        return out, len(sessions), len(rows)

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
            pool.checksums.set(slot, f.checksum(tag, slot), proven=True)
        return True

    def prefetch(self, form: str, slots: list[int]) -> None:
        """Start reading these slots of the `form` file (`DiskFile.prefetch`): they are read next."""
        if slots:
            self.files[form].prefetch(slots)

    def verify(self, form: str, slot: int, tag: bytes) -> bool:
        """Whether the slot holds the chunk whose identity tag is `tag` (checked once per write/open)."""
        pool, f = self.pool_of(form), self.files[form]
        if pool.checksums.proven(slot):
            return True
        if pool.checksums.get(slot) == f.checksum(tag, slot):
            pool.checksums.prove(slot)
            return True
        self.checksum_failures += 1
        return False

    def retag(self, form: str, slot: int, old: bytes, new: bytes) -> bool:
        """The chunk in `slot` now stands for a shorter prefix (its history was cut inside it):
        verify it under its old tag, then checksum it under the new one. False if it fails."""
        if not self.verify(form, slot, old):
            return False
        self.pool_of(form).checksums.set(slot, self.files[form].checksum(new, slot), proven=True)
        return True

    def commit(self, sessions: dict[str, SessionRow] | None, rows) -> bool:
        """Make this the durable index (`sessions` None: `rows` are the changed sessions' only, as
        `DiskIndex.commit_changes` takes them); then slots in limbo are free. False (degraded) if it fails."""
        try:
            if sessions is None:
                self.directory.index.commit_changes(rows)
            else:
                self.directory.index.commit({}, sessions, rows)
        except (OSError, sqlite3.Error):
            self._failed("commit")
            return False
        self.failing.discard("commit")
        for pool in (self.pool, self.hidden_pool):
            if pool is not None:
                pool.release_limbo()
        return True

    def failed(self, step: str) -> None:
        """A durability step ("flush", "commit") failed outside the tier (the writer's own flush): degraded."""
        self._failed(step)

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
        for pool in (self.pool, self.hidden_pool):
            if pool is not None:
                pool.unmap()
        self.directory.close()
