"""Prefix sharing in the store: full chunks of identical prefixes held once, by every session that has them.

Owns: the prefix index (`prefix/index.py`), and is the one writer of `Chunk.entry` and
`Session.scope`. A shared chunk is ONE `Chunk` object that sits at the same index k in the chunk
list of every holder (`entry.holders`); the store's parts change a chunk's state in place
(`Chunk.assign`), so a move of a shared chunk is a move for every holder. Collaborators: the
session table (holders by id), and the caller's `free` (gives a chunk's slots back to its pools).

What may happen to a shared chunk (the rules; `integrity.check_sharing` asserts the structural ones):
- It is full and immutable: no step writes into it. A session whose history is cut inside it
  (`truncate`) lets go of it (`detach`) and recomputes the tokens it keeps, < one chunk.
- It enters a session by `adopt` (a turn's prompt starts with indexed chunks, verified id by id) and
  the index by `register` (a step committed a full DEVICE chunk whose parent is indexed).
- It moves between device, host and hidden states in place, once for all holders; it moves only
  when no holder is busy (a running request reads it) and none is excluded, and the policy ranks it
  by its most valuable holder (`Placement.victims`: the key is the max over holders).
- It goes to disk (DISK, DISK_HIDDEN) once for all holders and stays shared and indexed there: one
  disk slot, named by a row of each holder in the disk index (same k, same checksum: the identity
  tag chains the prefix's ids, the same for every holder). It comes up in place, proven once (the
  proof is per slot). A disk chunk that fails its proof leaves the index (`withdraw`) and is
  dropped by each holder as it reads it: every holder recomputes it, none is served it.
- It is never DROPPED shared: before a drop (the policy ranked it lowest over all its holders, or a
  move names "dropped"), `unshare` leaves it to one holder (the session the move names, or the one
  the policy picked it through), which drops it; it leaves the index, and the other holders get a
  DROPPED chunk: all recompute it, or adopt it again once it is indexed anew.
- After a restart, `restore` rebuilds what the disk index kept: sessions' scopes, one chunk (with an
  entry naming its holders) per slot that several sessions' rows name, and the index of each
  session's leading full disk chunks, so a new session adopts a saved prefix from disk.
- A session that lets go (`detach`: delete, truncate, a refill) leaves it to the others; the last
  holder frees it (and it leaves the index with every entry below it, `PrefixIndex.remove`).

Sharing needs the paged layout (a virtual layout keeps each session's KV in its own contiguous
slot) and no layer-wise KV (LAYERED chunks split one device block by residue among sessions).
Every method runs with the store lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ..sessions.session import ON_DISK, Chunk, ChunkState, Session
from ..sessions.tenant import tenant_of
from .index import PrefixEntry, PrefixIndex, PrefixScope

DEVICE, DROPPED = ChunkState.DEVICE, ChunkState.DROPPED

Items = list[tuple[Session, int]]


class PrefixSharing:
    """`enabled` False (`prefix_sharing=False`, or a layout that cannot share): nothing is adopted or
    indexed, so no chunk is ever shared and the other methods find no entries to act on."""

    def __init__(self, block_size: int, session: Callable[[str], Session | None], enabled: bool = True,
                 changed: Callable[[str], None] = lambda sid: None,
                 chunk_changed: Callable[[Chunk], None] = lambda c: None):
        self.index = PrefixIndex(block_size)
        self.block_size, self.enabled = block_size, enabled
        self._session = session      # session id -> Session (None if gone)
        self._changed = changed      # a session whose chunks this changed for it (`SessionTable.recount`)
        self._chunk_changed = chunk_changed   # a chunk whose entry or holders this changed (`recount_chunk`)
        # Bumped whenever a chunk may leave a session's indexed run: an entry leaves the index
        # (`_remove`) or a session lets go of a shared chunk (`detach`). A `Session.index_cursor` of
        # an older epoch is void (register walks from chunk 0 again).
        self.epoch = 0
        # A superset of the sessions holding a chunk that 2+ sessions hold (`sharing_sessions` prunes it):
        # a holder joins when an entry it holds gets a second holder, or as it joins one that has.
        self.sharers: set[str] = set()

    # ---- scope ----------------------------------------------------------------------------------

    def scope(self, s: Session, cache_salt: str | None = None) -> PrefixScope:
        """The session's sharing scope: its tenant and the `cache_salt` of its first turn. A later
        turn with another salt is refused (ValueError): its history was shared under the first."""
        if s.scope is not None and s.scope.cache_salt == cache_salt:
            return s.scope                 # a returning turn: its tenant was checked at the first
        want = PrefixScope(tenant_of(s.session_id), cache_salt)
        if s.scope is None:
            s.scope = want
        elif s.scope != want and s.token_ids:
            raise ValueError(f"session {s.session_id!r} was opened with cache_salt {s.scope.cache_salt!r}; a turn "
                             f"with cache_salt {cache_salt!r} cannot continue it (use a new session)")
        else:
            s.scope = want
        return s.scope

    # ---- sessions take and let go -------------------------------------------------------------

    def adopt(self, s: Session, prompt: Sequence[int], cache_salt: str | None, release: Callable[[Session, int], None]
              ) -> int:
        """Before a turn: chunks of the longest indexed prefix of `prompt` (at least one token short of
        it, so the turn computes logits) replace the session's DROPPED chunks where its history equals
        the prompt, and extend its history if that is a prefix of the prompt (a partial last chunk is
        replaced by the full shared one: `release(s, k)`, the store's, lets go of it). Returns the
        tokens of history the session gained or got back."""
        scope = self.scope(s, cache_salt)
        if not self.enabled:
            return 0
        bs = self.block_size
        usable = (len(prompt) - 1) // bs
        entries = self.index.match(scope, prompt, usable)
        if not entries:
            return 0
        common = 0
        for a, b in zip(s.token_ids, prompt):
            if a != b:
                break
            common += 1
        got, n_full = 0, common // bs
        for k in range(min(n_full, len(entries))):          # dropped chunks of its own history come back
            if s.chunks[k].state is DROPPED and s.chunks[k].entry is None:
                self._hold(s, k, entries[k])
                got += bs
        n_full = len(s.token_ids) // bs
        if common == len(s.token_ids) and len(entries) > n_full:     # its history is a prefix of the prompt
            if len(s.token_ids) > n_full * bs:                 # its partial last chunk: the full shared one
                release(s, n_full)
                del s.chunks[n_full:]
                del s.token_ids[n_full * bs:]
            for k in range(n_full, len(entries)):
                s.chunks.append(Chunk())
                s.token_ids.extend(prompt[k * bs:(k + 1) * bs])
                self._hold(s, k, entries[k])
                got += bs
        return got

    def fork(self, parent: Session, child: Session, n: int, skip: Iterable[int] = ()) -> int:
        """`child` (new, empty, of the parent's tenant) takes the parent's first `n` full chunks: each
        with KV, outside `skip`, becomes one chunk of both (a private one gets an entry outside the index,
        as `restore` gives one: shared, unfindable until a holder's `register` indexes it); the others
        are fresh DROPPED chunks of `child`. Sets the child's scope and ids. Returns the chunks shared."""
        bs, skip, shared = self.block_size, set(skip), 0
        assert not child.chunks and not child.token_ids and n * bs <= len(parent.token_ids), (child, n)
        child.scope = parent.scope
        child.token_ids.extend(parent.token_ids[: n * bs])
        scope = parent.scope if parent.scope is not None else PrefixScope(tenant_of(parent.session_id))
        keys = None
        for k in range(n):
            c = parent.chunks[k]
            if c.state is DROPPED or c.source is not None or c.residue_block is not None or k in skip:
                child.chunks.append(Chunk())   # no KV to share (or not yet: a rebuild or fill in flight)
                continue
            if c.entry is None:
                keys = keys if keys is not None else list(self.index.keys(scope, parent.token_ids[: n * bs]))
                c.entry = PrefixEntry(keys[k], scope, k, tuple(parent.token_ids[k * bs:(k + 1) * bs]), None, c,
                                      {parent.session_id})
                self._changed(parent.session_id)
            child.chunks.append(c)
            self._chunk_changed(c)
            if c.entry in self.index:
                self.index.acquire(c.entry, child.session_id)
            else:
                c.entry.holders.add(child.session_id)
            self._joined(c.entry, child.session_id)
            shared += 1
        return shared

    def _hold(self, s: Session, k: int, e: PrefixEntry) -> None:
        if e.payload.state is DROPPED:
            raise AssertionError("an indexed chunk without KV")
        s.chunks[k] = e.payload
        self.index.acquire(e, s.session_id)
        self._joined(e, s.session_id)
        self._chunk_changed(e.payload)
        self._changed(s.session_id)

    def _joined(self, e: PrefixEntry, session_id: str) -> None:
        """`session_id` holds `e` now: it and, when it is the second, the first holder become sharers."""
        if len(e.holders) == 2:
            self.sharers.update(e.holders)
        elif len(e.holders) > 2:
            self.sharers.add(session_id)

    def sharing_sessions(self, sessions: Callable[[str], Session | None]) -> list[Session]:
        """Every session holding a chunk that another session holds too (`sessions`: id -> the table's
        session or None). O(the sharers marked since the last call); those that hold none are forgotten."""
        out = []
        for sid in self.sharers:
            s = sessions(sid)
            if s is not None and any(c.shared for c in s.chunks):
                out.append(s)
        if len(out) < len(self.sharers):      # a new set: one that shrank by discards is iterated at its peak size
            self.sharers = {s.session_id for s in out}
        return out

    def register(self, s: Session, free: Callable[[Chunk], None]) -> None:
        """After a committed step: the session's full DEVICE chunks, from the first not yet indexed,
        join the index (each under its parent's entry). A chunk whose content another session has
        indexed already (both computed it) is replaced by that one (its block is freed by `free`)
        when that one is on the device; otherwise the chain stops there.

        Incremental: the walk starts at the chunk where the last one stopped (`Session.index_cursor`)
        unless the epoch moved since; the chunks before it are indexed then (`integrity.check_sharing`
        asserts it), and a walk over them would only pass them by (`parent = c.entry`)."""
        if not self.enabled or s.scope is None:
            return
        n = len(s.token_ids) // self.block_size
        epoch, start = s.index_cursor
        start = min(start, n) if epoch == self.epoch else 0
        parent = s.chunks[start - 1].entry if start else None
        s.index_cursor = (self.epoch, self._walk(s, start, n, parent, free))

    def _walk(self, s: Session, start: int, n: int, parent: PrefixEntry | None, free: Callable[[Chunk], None]
              ) -> int:
        """`register`'s walk over chunks [start, n) of `s` under `parent`; returns where it stopped
        (chunks before it are indexed)."""
        for k in range(start, n):
            c = s.chunks[k]
            if c.entry is not None:
                if c.entry not in self.index:                # shared, but left the index with a parent
                    e = self.index.insert(s.scope, s.token_ids, k, parent, c)
                    if e is None or e.payload is not c:
                        return k
                    e.holders, c.entry = c.entry.holders, e       # indexed again, same holders
                    if len(e.holders) > 1:
                        self.sharers.update(e.holders)
                parent = c.entry
                continue
            if c.state is not DEVICE or c.source is not None:
                return k
            e = self.index.insert(s.scope, s.token_ids, k, parent, c)
            if e is None:
                return k                                     # a collision: the chunk stays private
            if e.payload is not c:
                if e.payload.state is not DEVICE:
                    return k
                free(c)
                c.assign(DROPPED)
                s.chunks[k] = e.payload
            else:
                c.entry = e
            self.index.acquire(e, s.session_id)
            self._joined(e, s.session_id)
            self._chunk_changed(e.payload)
            self._changed(s.session_id)
            parent = e
        return n

    def detach(self, s: Session, k: int) -> bool:
        """Session `s` lets go of its chunk k (it becomes a fresh DROPPED chunk of `s`). True when other
        sessions still hold the chunk (its slots stay); False when the caller must free them (the
        chunk was private, or `s` was its last holder: it has left the index then)."""
        c = s.chunks[k]
        e = c.entry
        if e is None:
            return False
        self.epoch += 1
        left = self.index.release(e, s.session_id)
        self._chunk_changed(c)
        self._changed(s.session_id)
        if left:
            s.chunks[k] = Chunk()
            return True
        if e in self.index:
            self._remove(e)
        c.entry = None
        return False

    def privatize(self, s: Session, k: int) -> bool:
        """Make chunk k of `s` private if `s` alone holds it (it leaves the index, with every entry
        below it). False if other sessions hold it too (it stays shared)."""
        e = s.chunks[k].entry
        if e is None:
            return True
        if e.holders != {s.session_id}:
            return False
        if e in self.index:
            self._remove(e)
        self.index.release(e, s.session_id)
        s.chunks[k].entry = None
        self._chunk_changed(s.chunks[k])
        self._changed(s.session_id)
        return True

    def unshare(self, items: Items) -> Items:
        """Before a drop of these chunks: each shared one becomes private to the session named in
        `items` (it leaves the index, and so does every entry below it; its other holders get fresh
        DROPPED chunks: they recompute it, or adopt it again once it is indexed anew). Returns `items`
        with one (session, k) per physical chunk."""
        items = self.unique(items)
        for s, k in items:
            c = s.chunks[k]
            e = c.entry
            if e is None:
                continue
            for h in sorted(e.holders - {s.session_id}):
                self.index.release(e, h)
                self._session(h).chunks[k] = Chunk()
                self._changed(h)
            if e in self.index:
                self._remove(e)
            self.index.release(e, s.session_id)
            c.entry = None
            self._chunk_changed(c)
            self._changed(s.session_id)
        return items

    def withdraw(self, s: Session, k: int) -> None:
        """Chunk k of `s` cannot be served (its disk slot failed its proof): it leaves the index, with
        every entry below it, so no session adopts it; its holders keep it (each finds it bad as it
        reads it, and drops it)."""
        e = s.chunks[k].entry
        if e is not None and e in self.index:
            self._remove(e)

    def restore(self, loaded: Sequence[tuple[Session, PrefixScope | None]]) -> None:
        """After a restart (`DiskState.load`, which made one chunk object of each slot that several
        sessions' rows name): sets each session's scope; gives each chunk held by several sessions
        an entry naming them all; then indexes each session's leading full disk chunks in its scope
        (a chunk whose content another one already indexes ends that session's chain: it stays as
        it is). Sessions without a scope are not indexed."""
        bs, held = self.block_size, {}
        self.epoch += 1
        for s, scope in loaded:
            s.scope = scope
            for k, c in enumerate(s.chunks):
                if c.state is not DROPPED:
                    held.setdefault(id(c), []).append((s, k))
        for group in held.values():
            if len(group) > 1:
                s, k = group[0]
                *_, key = self.index.keys(s.scope, s.token_ids[: (k + 1) * bs])
                s.chunks[k].entry = PrefixEntry(key, s.scope, k, tuple(s.token_ids[k * bs:(k + 1) * bs]), None,
                                                s.chunks[k], {h.session_id for h, _ in group})
                self.sharers.update(h.session_id for h, _ in group)
                self._chunk_changed(s.chunks[k])
                for h, _ in group:
                    self._changed(h.session_id)
        for s, scope in loaded if self.enabled else ():
            parent = None
            for k in range(len(s.token_ids) // bs if scope is not None else 0):
                c = s.chunks[k]
                if c.state not in ON_DISK:
                    break
                if c.entry is None or c.entry not in self.index:
                    e = self.index.insert(scope, s.token_ids, k, parent, c, parent_checked=True)   # chunk k - 1's
                    if e is None or e.payload is not c:
                        break
                    if c.entry is not None:
                        e.holders = c.entry.holders          # shared: its holders carry over
                    c.entry = e
                    self.index.acquire(e, s.session_id)
                    self._joined(e, s.session_id)
                    self._chunk_changed(c)
                    self._changed(s.session_id)
                parent = c.entry

    def _remove(self, top: PrefixEntry) -> None:
        """`top` and every entry below it leave the index: those whose chunk no session holds any more
        cannot exist (the last holder frees a chunk); the others stay shared among their holders,
        unfindable. Every session's indexed run may end earlier now: the epoch moves."""
        self.epoch += 1
        for e in self.index.remove(top):
            if not e.holders:
                e.payload.entry = None
                self._chunk_changed(e.payload)

    def retainable(self, s: Session) -> int:
        """Chunks of `s` worth keeping when it is deleted with `keep_shared`: its leading indexed chunks
        up to the last one that no other session holds (0: nothing would be lost)."""
        n = 0
        for k, c in enumerate(s.chunks):
            if c.entry is None or c.entry not in self.index:
                break
            if c.entry.holders == {s.session_id}:
                n = k + 1
        return n

    def findable(self, s: Session) -> bool:
        """Whether chunk 0 of `s` is in the index (else none of its chunks can be found)."""
        return bool(s.chunks) and s.chunks[0].entry is not None and s.chunks[0].entry in self.index

    # ---- what may move, and its rank -----------------------------------------------------------

    @staticmethod
    def unique(items: Iterable[tuple[Session, int]]) -> Items:
        """`items` with one (session, k) per physical chunk (the first seen)."""
        seen, out = set(), []
        for s, k in items:
            if id(s.chunks[k]) not in seen:
                seen.add(id(s.chunks[k]))
                out.append((s, k))
        return out

    def free_to_move(self, c: Chunk, exclude: set[str]) -> bool:
        """Whether no holder of `c` is busy or in `exclude` (a private chunk: always; its session was checked)."""
        if c.entry is None:
            return True
        for h in c.entry.holders:
            hs = self._session(h)
            if h in exclude or hs is None or hs.busy:
                return False
        return True

    def holders(self, s: Session, k: int) -> list[Session]:
        """Sessions holding chunk k of `s` (just `s` for a private chunk)."""
        e = s.chunks[k].entry
        if e is None:
            return [s]
        return [self._session(h) for h in sorted(e.holders)]

    def holder_ids(self, items: Iterable[tuple[Session, int]]) -> set[str]:
        """Ids of every session holding one of these chunks (a shared chunk: all its holders)."""
        out = set()
        for s, k in items:
            e = s.chunks[k].entry
            if e is None:
                out.add(s.session_id)
            else:
                out.update(e.holders)
        return out

