"""Disk copies: chunks held in two tiers, served from the device or host and copied to disk behind them.

A `DiskCopy` is a disk KV slot holding the same bytes as a chunk still served from above (DEVICE or
HOST; also HIDDEN or a shadow later): written by the write-behind writer or the flush on close
(`disk/writer.py`), named by the disk index like a DISK chunk's slot (a row of each holder), so a
restart finds it. The chunk object keeps its one serving place (`Chunk`'s invariant is unchanged);
this table is the second place.

The rule for a chunk held in two tiers (`check_integrity` asserts the first two):
  1. the copy's slot is owned by the copy alone (not free, not in limbo, no other chunk's), with the
     checksum of (the chunk's identity tag when it was copied, its bytes);
  2. the index names it only while the copy is *valid*: a session still holds that chunk object at that
     index (the one it is recorded for, or another holder of a shared chunk: `sweep` then records it for
     that one), the chunk is not itself on disk, and its identity tag is unchanged
     (the tag chains the prefix's ids up to the chunk's end, so a partial chunk that grew, a cut, or
     another prefix changes it: the KV would differ);
  3. a copy that is no longer valid is freed into limbo (`sweep`), so its slot is rewritten only once
     a committed index no longer names it (the crash ordering of `disk/tier.py`); until then the
     committed row stays true (old ids, old bytes);
  4. evicting the chunk to disk takes its copy's slot (no write: `take`); making room on disk frees
     copies first (they are redundant while the chunk is served from above: `release`).
A copy is made by the writer (a chunk served from above, copied down) or by a swap-in (`keep`: a KV chunk
read up from disk keeps the slot it was read from, so its rows stay as committed, for every holder of a
shared one, and evicting it again is free).
Every method runs with the store lock held.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..sessions.session import ON_DISK, Chunk, Session, SessionTable
from .file import identity_tags
from .pool import DiskPool


@dataclass(frozen=True, slots=True)
class DiskCopy:
    """Chunk `k` of session `session_id` (the object `chunk`), copied into KV `slot` of the disk tier
    when its identity tag was `tag` (the slot's checksum covers tag and bytes). `named`: the sessions whose
    rows have named it (a shared chunk's holders come and go): all are recommitted when it is freed or taken."""

    session_id: str
    k: int
    chunk: Chunk
    tag: bytes
    slot: int
    named: set[str] = field(default_factory=set)


class DiskCopies:
    """The disk copies of chunks served from above, by chunk object (id) and by slot."""

    def __init__(self, sessions: SessionTable, pool: DiskPool, block_size: int,
                 mark: Callable[[Iterable[str]], None]):
        self.sessions, self.pool, self.block_size, self.mark = sessions, pool, block_size, mark
        self._by_chunk: dict[int, DiskCopy] = {}
        self._by_slot: dict[int, DiskCopy] = {}
        self.pending: set[int] = set()     # disk slots allocated for copies being written (no checksum yet)
        self.freed = 0            # copies freed because their chunk changed or went (counted)

    def __len__(self) -> int:
        return len(self._by_chunk)

    def slots(self) -> set[int]:
        """The slots copies own (integrity)."""
        return set(self._by_slot)

    def of(self, c: Chunk) -> DiskCopy | None:
        """The copy recorded for chunk object `c` (maybe no longer valid: `valid`)."""
        cp = self._by_chunk.get(id(c))
        return cp if cp is not None and cp.chunk is c else None

    def held(self, s: Session) -> bool:
        """Whether any chunk of `s` has a recorded copy (cheap: no tags)."""
        return bool(self._by_chunk) and any(self.of(c) is not None for c in s.chunks)

    def valid_in(self, s: Session, tags: list[bytes] | None = None) -> dict[int, DiskCopy]:
        """{k: copy} of the session's chunks whose copy is valid now (rule 2). `tags`: its identity tags,
        if the caller has them."""
        if not self._by_chunk:
            return {}
        found = {k: cp for k, c in enumerate(s.chunks) if (cp := self.of(c)) is not None and c.state not in ON_DISK}
        if not found:
            return {}
        tags = identity_tags(s.token_ids, self.block_size) if tags is None else tags
        return {k: cp for k, cp in found.items() if k < len(tags) and tags[k] == cp.tag}

    def stale_holders(self) -> set[str]:
        """Sessions (and holders of its shared chunk) of every copy no longer valid, not swept yet
        (integrity: O(copies), tags of their sessions)."""
        out, tags = set(), {}
        for cp in self._by_chunk.values():
            s = self._holder(cp)
            ok = s is not None and cp.chunk.state not in ON_DISK
            if ok:
                if s.session_id not in tags:
                    tags[s.session_id] = identity_tags(s.token_ids, self.block_size)
                ok = cp.k < len(tags[s.session_id]) and tags[s.session_id][cp.k] == cp.tag
            if not ok:
                out.add(cp.session_id)
                out.update(cp.chunk.entry.holders if cp.chunk.entry is not None else ())
        return out

    def add(self, cp: DiskCopy) -> None:
        """Record a copy whose slot was written, flushed and checksummed (proven) for `cp.tag`."""
        assert id(cp.chunk) not in self._by_chunk and cp.slot not in self._by_slot, cp
        self._by_chunk[id(cp.chunk)] = cp
        self._by_slot[cp.slot] = cp

    def keep(self, s: Session, k: int, tag: bytes) -> None:
        """Chunk k of `s`, a DISK chunk proven for `tag` (its identity tag now), is read up a tier: its slot becomes
        its copy (rule 1 holds: the slot was the chunk's alone, its checksum kept). Every holder's committed rows
        name the slot already (`named`). The caller reassigns the chunk without freeing the slot."""
        c = s.chunks[k]
        assert c.state in ON_DISK and self.pool.checksums.proven(c.loc), "only a proven disk chunk keeps its slot"
        if (stale := self.of(c)) is not None:   # a copy it had before it went to disk (invalid since: rule 3)
            self._free(stale)
            self.freed += 1
        self.add(DiskCopy(s.session_id, k, c, tag, c.loc,
                          set(c.entry.holders) if c.entry is not None else {s.session_id}))

    def take(self, c: Chunk) -> int:
        """The chunk is being evicted to disk onto its copy (valid: the caller checked): forget the copy,
        return its slot (now the chunk's own, checksum kept)."""
        cp = self._by_chunk.pop(id(c))
        del self._by_slot[cp.slot]
        self.mark(cp.named)                     # sessions that let go of it since: their rows leave the index
        return cp.slot

    def _free(self, cp: DiskCopy) -> None:
        del self._by_chunk[id(cp.chunk)]
        del self._by_slot[cp.slot]
        self.pool.free([cp.slot])               # limbo until a committed index no longer names it
        self.mark({cp.session_id, *cp.named, *(cp.chunk.entry.holders if cp.chunk.entry is not None else ())})

    def _holder(self, cp: DiskCopy) -> Session | None:
        """A session holding the copy's chunk object at its index: its own, or another holder of a shared one."""
        e = cp.chunk.entry
        for sid in itertools.chain((cp.session_id,), e.holders if e is not None else ()):
            s = self.sessions.find(sid)
            if s is not None and cp.k < len(s.chunks) and s.chunks[cp.k] is cp.chunk:
                return s
        return None

    def sweep(self, session_ids: set[str] | None = None) -> int:
        """Free copies no longer valid (rule 3): of every copy, whether a session still holds that chunk
        object off disk (its session, or another holder of a shared one: the copy is then recorded for it, so a
        short-lived holder leaving does not cost the others their copy); of the sessions in `session_ids` (None:
        all) and of re-recorded copies, also whether its tag is unchanged. Returns how many were freed."""
        stale, tags = [], {}
        for cp in list(self._by_chunk.values()):
            s = self._holder(cp)
            moved = s is not None and s.session_id != cp.session_id
            if moved:
                cp = self._by_chunk[id(cp.chunk)] = self._by_slot[cp.slot] = DiskCopy(
                    s.session_id, cp.k, cp.chunk, cp.tag, cp.slot, cp.named)
            if s is None or cp.chunk.state in ON_DISK:
                stale.append(cp)
            elif moved or session_ids is None or cp.session_id in session_ids:
                if cp.session_id not in tags:
                    tags[cp.session_id] = identity_tags(s.token_ids, self.block_size)
                t = tags[cp.session_id]
                if cp.k >= len(t) or t[cp.k] != cp.tag:
                    stale.append(cp)
        for cp in stale:
            self._free(cp)
        self.freed += len(stale)
        return len(stale)

    def release(self, n: int) -> int:
        """Free up to `n` copies (rule 4: the disk needs room): those no longer valid (`sweep`), then of the least
        recently active sessions first. Returns how many (the sweep may free more than `n`); they leave limbo at the
        next commit."""
        def last_active(cp) -> float:      # a copy whose session is gone goes first
            s = self.sessions.find(cp.session_id)
            return float("-inf") if s is None else s.last_active

        swept = self.sweep()                   # stale copies first (a grown or cut chunk's)
        order = sorted(self._by_chunk.values(), key=last_active)
        for cp in order[:max(n - swept, 0)]:
            self._free(cp)
        return swept + min(len(order), max(n - swept, 0))

