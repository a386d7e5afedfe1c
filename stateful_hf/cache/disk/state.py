"""The disk state: the store's side of the disk tier (`disk/tier.py`): what its index says, what is
written and what is proven before it is read.

Owns: whether the committed index is stale (`mark_changed`, cleared by a successful `sync`).
Collaborators: the session table (read: the rows of the index; `load` adds sessions), the disk
tier, the transfer engine (copies into disk slots land before they are checksummed). It never frees
a slot itself: `verify` and `cut` return what failed and the caller (placement) drops those chunks.

Rules (see `disk/tier.py` for the crash ordering):
- a chunk becomes DISK / DISK_HIDDEN only after its data is flushed (`written`);
- a disk chunk is read (copied up, rebuilt from, exported) only after `verify` proved it is the
  chunk of its session's prefix; one that fails is dropped and recomputed from its token ids;
- `sync` never raises: a failed commit leaves the tier degraded, the last committed index true, and
  the change pending (retried on later syncs and moves).
Every method runs with the store lock held.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from ...kernels.blocks import blocks_for
from ..errors import StoreError
from ..movement.transfer import Transfer
from ..prefix.index import PrefixScope
from ..prefix.sharing import PrefixSharing
from ..sessions.session import ON_DISK, Chunk, ChunkState, Session, SessionTable
from ..sessions.tenant import tenant_of
from .copies import DiskCopies
from .file import identity_tags
from .index import SessionRow, pack_ids
from .tier import DiskTier

DISK, DISK_HIDDEN = ChunkState.DISK, ChunkState.DISK_HIDDEN
FORM = {DISK: "kv", DISK_HIDDEN: "hidden"}


class DiskState:
    """Built only for a store with a disk tier (otherwise the store has no disk state)."""

    def __init__(self, sessions: SessionTable, disk: DiskTier, transfer: Transfer, block_size: int):
        self.sessions, self.disk, self.transfer, self.block_size = sessions, disk, transfer, block_size
        self._changed = False                  # rows of sessions not in `_dirty` may have changed: commit them all
        self._dirty: set[str] = set()          # sessions whose rows may have changed since the last commit
        # a change that must commit at once (new disk chunks, a retag, a removed session, unknown sessions); the
        # others only free slots into limbo or drop rows, so the committed index stays true until a later commit
        self.urgent = False
        self.copies = DiskCopies(sessions, disk.pool, block_size, self.mark_changed)   # chunks in two tiers

    def mark_changed(self, session_ids: Iterable[str] | None = None) -> None:
        """A disk slot was filled or freed, or a session's ids up to a disk chunk changed: of these
        sessions (None: of any). `SessionTable.mark` calls it for every session it marks."""
        if session_ids is None:
            self._changed = self.urgent = True
        else:
            ids = tuple(session_ids)
            self._dirty.update(ids)
            if not self.urgent and any(self.sessions.find(sid) is None for sid in ids):
                self.urgent = True             # a removed session: a restart must not bring it back

    def session_rows(self, s: Session) -> tuple[SessionRow | None, dict[int, tuple[str, int, int]]]:
        """The index of one session now: its ids up to its last disk chunk, its scope and whether it is
        retained (None without a disk chunk), and (form, slot, checksum) per such chunk (chunks
        rebuilding from a disk hidden slot name that slot: a crash before the step commits finds
        them there; a chunk served from above with a valid disk copy names the copy's slot: `disk/copies.py`).
        A chunk shared by several sessions is a row of each, naming one slot."""
        rows, last = {}, -1
        copies = self.copies.valid_in(s) if self.copies.held(s) else {}
        for k, c in enumerate(s.chunks):
            at = (c.state, c.loc) if c.state in ON_DISK else c.source
            if at is not None and at[0] in ON_DISK:
                form = FORM[at[0]]
                rows[k] = (form, at[1], self.disk.pool_of(form).checksums[at[1]])
                last = k
            elif k in copies:
                rows[k] = ("kv", copies[k].slot, self.disk.pool.checksums[copies[k].slot])
                copies[k].named.add(s.session_id)       # recommitted when the copy goes (a holder may leave)
                last = k
        if last < 0:
            return None, rows
        tenant, salt = (s.scope.tenant, s.scope.cache_salt) if s.scope is not None else (None, None)
        return (pack_ids(s.token_ids[: (last + 1) * self.block_size]), tenant, salt, s.retained), rows

    def rows(self) -> tuple[dict[str, SessionRow], dict[tuple[str, int], tuple[str, int, int]]]:
        """The index of the current state, every session's `session_rows`."""
        sessions, rows = {}, {}
        for s in self.sessions:
            row, chunks = self.session_rows(s)
            if row is not None:
                sessions[s.session_id] = row
                rows.update(((s.session_id, k), r) for k, r in chunks.items())
        return sessions, rows

    def sync(self, force: bool = False) -> bool:
        """Commit the index if the disk state changed (or `force`): the changed sessions' rows, O(theirs),
        or every row after a change of unknown sessions. False if the commit failed."""
        if not (self._changed or self._dirty or force):
            return True
        if self._changed:
            ok = self.disk.commit(*self.rows())
        else:                                  # (the index writes only what differs from what it committed)
            ok = self.disk.commit(None, {sid: self.session_rows(s) if (s := self.sessions.find(sid)) is not None
                                         else (None, {}) for sid in self._dirty})
        if ok:
            self._changed, self._dirty, self.urgent = False, set(), False
        return ok

    @property
    def pending(self) -> bool:
        """Whether something is left to commit."""
        return self._changed or bool(self._dirty)

    def check(self) -> None:
        """Integrity: with nothing left to commit, the committed index is the state's (`rows`), but for the
        sessions whose rows involve a disk copy (`disk/copies.py`: one that went stale since, its chunk let go
        of, cut or grown, rule 3; or a shared copied chunk a holder let go of or adopted): their committed rows
        that differ need only be true (each names a slot a recorded copy owns, with that slot's checksum) until
        they are committed again."""
        index = self.disk.directory.index          # None once the tier is closed
        if (self._changed or self._dirty) or self.disk.degraded or index is None:
            return
        (c_sessions, c_rows), (sessions, rows) = index.read(), self.rows()
        copied = self.copies.slots()
        # sessions whose rows involve a copy: a stale one not swept yet, or a row naming a copy's slot (committed
        # or now: a holder of a shared copied chunk may have let go of it or adopted it since)
        involved = self.copies.stale_holders() | {sid for (sid, _), r in (*c_rows.items(), *rows.items())
                                                  if r[0] == "kv" and r[1] in copied}
        assert {k: v for k, v in c_sessions.items() if k not in involved} == \
            {k: v for k, v in sessions.items() if k not in involved}, "the disk index differs from the sessions' state"
        assert {k: v for k, v in c_rows.items() if k[0] not in involved} == \
            {k: v for k, v in rows.items() if k[0] not in involved}, "the disk index differs from the sessions' state"
        for (sid, k), (form, slot, checksum) in c_rows.items():
            if sid in involved and rows.get((sid, k)) != (form, slot, checksum):
                assert form == "kv" and slot in copied and self.disk.pool.checksums.get(slot) == checksum, (
                    f"the disk index names {form} slot {slot} for ({sid!r}, {k}): neither the state's nor a copy's")

    def usable(self, strict: bool) -> bool:
        """Before a move to disk: a degraded tier retries its commit first. If it still fails, the
        move cannot be made durable: StoreError if `strict` (nothing moved), else False."""
        if not self.disk.degraded or (self.disk.retry_flush() and self.sync(force=True)):
            return True
        if strict:
            raise StoreError(f"the disk tier {str(self.disk.dir)!r} is degraded (it cannot flush its data or commit "
                             "its index: full or failing filesystem); nothing was moved. Turns go on without it")
        return False

    def copied(self, items: list[tuple[Session, int]]) -> list[tuple[Session, int]]:
        """Those of `items` (chunks served from above) whose disk copy is valid: evicting them to disk
        takes the copy's slot, no write (`DiskCopies.take`)."""
        if not len(self.copies):
            return []
        valid: dict[str, dict] = {}
        out = []
        for s, k in items:
            if s.session_id not in valid:
                valid[s.session_id] = self.copies.valid_in(s)
            if k in valid[s.session_id]:
                out.append((s, k))
        return out

    def written(self, items: list[tuple[Session, int]], target: ChunkState, slots: list[int]) -> bool:
        """After `items` were copied into `slots` of the disk `target`: flush, record checksums. The
        copy lands first (transfer.py rule 2: the checksum and the flush read the destination)."""
        self.transfer.settle(self.disk.pool)
        self.urgent = True                     # new disk chunks: named by the next commit, at once
        return self.disk.write_done(FORM[target], slots, self._tags(items))

    def prefetch(self, items: list[tuple[Session, int]]) -> None:
        """These chunks are read up from disk next: start reading their slots (`DiskTier.prefetch`), every form's
        at once. Items not on disk are passed over."""
        slots: dict[str, list[int]] = {}
        for s, k in items:
            c = s.chunks[k]
            if c.state in ON_DISK:
                slots.setdefault(FORM[c.state], []).append(c.loc)
        for form, at in slots.items():
            self.disk.prefetch(form, at)

    def keep(self, items: list[tuple[Session, int]]) -> None:
        """These KV chunks on disk, proven, are being read up a tier: each keeps its slot as its disk copy
        (`DiskCopies.keep`), so no holder's rows change and evicting it again is free. The caller
        reassigns them without freeing their slots."""
        for (s, k), tag in zip(items, self._tags(items), strict=True):
            self.copies.keep(s, k, tag)

    def _tags(self, items: list[tuple[Session, int]]) -> list[bytes]:
        """The identity tag of each item's chunk, in order (one `identity_tags` per session)."""
        per: dict[str, list[bytes]] = {}
        for s, _ in items:
            if s.session_id not in per:
                per[s.session_id] = identity_tags(s.token_ids, self.block_size)
        return [per[s.session_id][k] for s, k in items]

    def failed(self, s: Session, ks=None) -> list[int]:
        """The session's disk chunks (of `ks`, default all) that do not prove to be what they name;
        the caller must drop them before anything reads them. Mutates nothing here; the slots to verify
        are read ahead of the checks (`DiskTier.prefetch`)."""
        ks = [k for k in (range(len(s.chunks)) if ks is None else ks) if s.chunks[k].state in ON_DISK]
        if not ks:
            return []
        self.prefetch([(s, k) for k in ks
                       if not self.disk.pool_of(FORM[s.chunks[k].state]).checksums.proven(s.chunks[k].loc)])
        tags = identity_tags(s.token_ids, self.block_size)
        return [k for k in ks if not self.disk.verify(FORM[s.chunks[k].state], s.chunks[k].loc, tags[k])]

    @staticmethod
    def row_holders(items: list[tuple[Session, int]], sharing: PrefixSharing) -> set[str]:
        """The sessions whose disk rows change when `items` are dropped: every holder of each."""
        return sharing.holder_ids(items)

    def cut(self, s: Session, k: int, old_ids: list[int]) -> bool:
        """Chunk k, on disk, lost its last tokens (a truncation inside it; `old_ids`: the ids up to its
        old end): checksum it under its new identity tag. False if it does not hold what it should (the
        caller drops it)."""
        c = s.chunks[k]
        self._dirty.update(c.entry.holders if c.entry is not None else (s.session_id,))
        self.urgent = True
        old_tag = identity_tags(old_ids, self.block_size)[k]
        return self.disk.retag(FORM[c.state], c.loc, old_tag, identity_tags(s.token_ids, self.block_size)[k])

    def load(self, sharing: PrefixSharing) -> None:
        """Sessions of the last committed index into the table: chunks named there are DISK /
        DISK_HIDDEN (unproven until read). Rows of sessions naming one slot become ONE chunk held by
        each when they can be one shared chunk (`_one_chunk`); `sharing.restore` then gives it an
        entry and indexes what it can. Rows that cannot be right are left out (recomputed): a chunk
        out of range, or a slot named again otherwise (the first claimant's row decides). Mutates:
        the table, the disk pools' taken slots and checksums, the prefix index (through `sharing`)."""
        bs = self.block_size
        taken: dict[str, dict[int, int]] = {"kv": {}, "hidden": {}}      # form -> {slot: checksum}
        claimant: dict[tuple[str, int], tuple[Session, int, PrefixScope | None]] = {}   # its first row's
        loaded: list[tuple[Session, PrefixScope | None]] = []
        scopes: dict[tuple[str, str | None, str | None], PrefixScope | None] = {}    # (tenant of id, tenant, salt)
        saved_sessions, n_sessions, n_rows = self.disk.saved_sessions()
        self.disk.directory.index.forget_opened()
        left_out = n_rows - sum(len(v.chunks) for v in saved_sessions.values())
        clock = self.sessions.clock
        for sid, saved in saved_sessions.items():
            s = Session(sid, array("i", saved.token_ids), last_active=clock(), retained=saved.retained)
            at = (tenant_of(sid), saved.tenant, saved.cache_salt)
            scope = scopes[at] if at in scopes else scopes.setdefault(at, _scope(*at))
            n = blocks_for(len(s.token_ids), bs)
            chunks: list[Chunk | None] = [None] * n
            for k, (form, slot, checksum) in sorted(saved.chunks.items()):
                if not 0 <= k < n:
                    left_out += 1
                elif slot not in taken[form]:
                    chunks[k] = Chunk(DISK if form == "kv" else DISK_HIDDEN, slot)
                    taken[form][slot] = checksum
                    claimant[form, slot] = (s, k, scope)
                elif sharing.enabled and checksum == taken[form][slot] and \
                        self._one_chunk(claimant[form, slot], (s, k, scope)):
                    first, fk, _ = claimant[form, slot]
                    chunks[k] = first.chunks[fk]            # the same chunk: shared again
                else:
                    left_out += 1
            if all(c is None for c in chunks) or (saved.tenant is not None and scope is None):
                left_out += 1           # its row would not be written so: no disk chunk, or no valid scope
            s.chunks = [Chunk() if c is None else c for c in chunks]
            loaded.append((s, scope))
        for form, slots in taken.items():
            pool = self.disk.pool_of(form)
            if pool is not None:
                pool.take(sorted(slots))
                for slot, checksum in slots.items():
                    pool.checksums.set(slot, checksum)
        sharing.restore(loaded)
        for s, _ in loaded:             # with their shared chunks' entries: the table lists those once (`TierOrder`)
            self.sessions.add(s)
        # Rows left out (recomputed) or written otherwise now leave or change at the next commit; else the
        # committed index is the state already (`check` asserts it).
        self._changed = left_out > 0 or len(saved_sessions) < n_sessions

    def _one_chunk(self, a: tuple[Session, int, PrefixScope | None], b: tuple[Session, int, PrefixScope | None]
                   ) -> bool:
        """Whether rows (session, k, scope) naming one slot with one checksum can be one shared chunk:
        the same k, the same scope (recorded), a full chunk in both, the same ids up to its end (the
        slot is proven once for all holders: their identity tags must be equal)."""
        (sa, ka, scope_a), (sb, kb, scope_b) = a, b
        end = (ka + 1) * self.block_size
        return (ka == kb and scope_a is not None and scope_a == scope_b and len(sa.token_ids) >= end
                and len(sb.token_ids) >= end and sa.token_ids[:end] == sb.token_ids[:end])


def _scope(id_tenant: str, tenant: str | None, cache_salt: str | None) -> PrefixScope | None:
    """The scope a session of tenant `id_tenant` (its id's) was saved with (None: none recorded, or not a
    valid one for its id)."""
    if tenant is None or tenant != id_tenant:
        return None
    try:
        return PrefixScope(tenant, cache_salt)
    except (TypeError, ValueError):
        return None
