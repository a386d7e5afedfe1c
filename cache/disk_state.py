"""The store's side of the disk tier (a mixin of SessionStore): what the index says, what is
written and what is proven before it is read. Every method runs with the store lock held.

Rules (see `disk.py` for the crash ordering):
- a chunk becomes DISK / DISK_HIDDEN only after its data is flushed (`_disk_written`);
- a disk chunk is read (copied up, rebuilt from, exported) only after `_verify_disk` proved it is
  the chunk of its session's prefix; one that fails is dropped and recomputed from its token ids;
- `_sync_disk` never raises: a failed commit leaves the tier degraded, the last committed index
  true, and the change pending (retried on later syncs and moves).
"""

from __future__ import annotations

from .disk_file import identity_tags
from .disk_index import pack_ids
from .errors import StoreError
from .session import Chunk, Session
from .tiering import DISK, DISK_HIDDEN, ON_DISK

FORM = {DISK: "kv", DISK_HIDDEN: "hidden"}


class DiskStateMixin:
    # provided by SessionStore: disk, _sessions, block_size, counters, _disk_dirty, _release, _ntok, clock

    def _disk_rows(self) -> tuple[dict[str, bytes], dict[tuple[str, int], tuple[str, int, int]]]:
        """The index of the current state: per session with chunks on disk, its ids up to its last
        one, and (form, slot, checksum) per such chunk (chunks rebuilding from a disk hidden slot
        name that slot: a crash before the step commits finds them there)."""
        sessions, rows = {}, {}
        for s in self._sessions.values():
            last = -1
            for k, c in enumerate(s.chunks):
                at = (c.state, c.loc) if c.state in ON_DISK else c.source
                if at is not None and at[0] not in ON_DISK:
                    at = None
                if at is not None:
                    form = FORM[at[0]]
                    rows[s.session_id, k] = (form, at[1], self.disk.pool_of(form).checksums[at[1]])
                    last = k
            if last >= 0:
                sessions[s.session_id] = pack_ids(s.token_ids[: (last + 1) * self.block_size])
        return sessions, rows

    def _sync_disk(self, force: bool = False) -> bool:
        """Commit the index if the disk state changed (or `force`). False if the commit failed."""
        if self.disk is None or not (self._disk_dirty or force):
            return True
        if not self.disk.commit(*self._disk_rows()):
            self._disk_dirty = True
            return False
        self._disk_dirty = False
        return True

    def _disk_usable(self, strict: bool) -> bool:
        """Before a move to disk: a degraded tier retries its commit first. If it still fails, the
        move cannot be made durable: StoreError if `strict` (nothing moved), else False."""
        if not self.disk.degraded or (self.disk.retry_flush() and self._sync_disk(force=True)):
            return True
        if strict:
            raise StoreError(f"the disk tier {str(self.disk.dir)!r} is degraded (it cannot flush its data or commit "
                             "its index: full or failing filesystem); nothing was moved. Turns go on without it")
        return False

    def _disk_written(self, items: list[tuple[Session, int]], target, slots: list[int]) -> bool:
        """After `items` were copied into `slots` of the disk `target`: flush, record checksums. The
        copy lands first (transfer.py rule 2: the checksum and the flush read the destination)."""
        self.transfer.settle(self.disk.pool)
        tags = {}
        for s, _ in items:
            if s.session_id not in tags:
                tags[s.session_id] = identity_tags(s.token_ids, self.block_size)
        return self.disk.write_done(FORM[target], slots, [tags[s.session_id][k] for s, k in items])

    def _verify_disk(self, s: Session, ks=None) -> int:
        """Prove the session's disk chunks (of `ks`, default all) before they are read; drop those
        that fail (their token ids stay: recomputed). Returns the tokens dropped."""
        if self.disk is None:
            return 0
        ks = [k for k in (range(len(s.chunks)) if ks is None else ks) if s.chunks[k].state in ON_DISK]
        if not ks:
            return 0
        tags, lost = identity_tags(s.token_ids, self.block_size), 0
        for k in ks:
            c = s.chunks[k]
            if not self.disk.verify(FORM[c.state], c.loc, tags[k]):
                n = self._ntok(s, k)
                lost += n
                self.counters.dropped += n
                self._release(s, k)
        return lost

    def _disk_cut(self, s: Session, k: int, old_tag: bytes) -> None:
        """Chunk k, on disk, lost its last tokens (a truncation inside it): checksum it under its new
        identity tag, or drop it if it does not hold what it should."""
        c = s.chunks[k]
        new_tag = identity_tags(s.token_ids, self.block_size)[k]
        if not self.disk.retag(FORM[c.state], c.loc, old_tag, new_tag):
            self.counters.dropped += self._ntok(s, k)
            self._release(s, k)
        self._disk_dirty = True

    def _load_disk_sessions(self) -> None:
        """Sessions of the last committed index: chunks named there are DISK / DISK_HIDDEN (unproven
        until read); rows that cannot be right (chunk out of range, a slot named twice) are left out."""
        taken: dict[str, dict[int, int]] = {"kv": {}, "hidden": {}}      # form -> {slot: checksum}
        for sid, (ids, chunks) in self.disk.saved_sessions().items():
            s = Session(sid, ids, last_active=self.clock())
            s.chunks = [Chunk() for _ in range(-(-len(ids) // self.block_size))]
            for k, (form, slot, checksum) in sorted(chunks.items()):
                if 0 <= k < len(s.chunks) and slot not in taken[form]:   # a slot named twice: the first
                    s.chunks[k] = Chunk(DISK if form == "kv" else DISK_HIDDEN, slot)  # claimant's checksum decides
                    taken[form][slot] = checksum
            self._sessions[sid] = s
        for form, slots in taken.items():
            pool = self.disk.pool_of(form)
            if pool is not None:
                pool.take(sorted(slots))
                pool.checksums = dict(slots)
        self._disk_dirty = True
