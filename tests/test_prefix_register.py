"""`PrefixSharing.register` is incremental (it starts at `Session.index_cursor`): the same result as a
walk from chunk 0 on every commit. Model-free: sessions, chunks and the sharing part alone, driven by
the operations the store's parts perform on them (a step's growth, a drop's `unshare`, a failed
proof's `withdraw`, a cut's `detach` / `privatize`, a turn's `adopt`, a refill)."""

from __future__ import annotations

import random

import pytest

from stateful_hf.cache.audit.integrity import check_sharing
from stateful_hf.cache.prefix.sharing import PrefixSharing
from stateful_hf.cache.sessions.session import Chunk, ChunkState, Session

BS = 4
DEVICE, DROPPED = ChunkState.DEVICE, ChunkState.DROPPED
SYSTEM = [random.Random(1).randrange(3, 50) for _ in range(6 * BS)]


class World:
    """Sessions over one `PrefixSharing`; `full_walk` makes every register walk from chunk 0 (the
    behaviour before the cursor), by voiding the cursor first."""

    def __init__(self, full_walk: bool):
        self.sessions: dict[str, Session] = {}
        self.sharing = PrefixSharing(BS, self.sessions.get)
        self.full_walk, self.slots, self.freed = full_walk, 0, []

    def slot(self) -> int:
        self.slots += 1
        return self.slots

    def release(self, s: Session, k: int) -> None:        # TierPools.release without pools
        if not self.sharing.detach(s, k):
            self.freed.append(s.chunks[k].loc)
            s.chunks[k] = Chunk()

    def open(self, sid: str, prompt: list[int]) -> Session:
        s = self.sessions.setdefault(sid, Session(sid))
        self.sharing.adopt(s, prompt, None, self.release)
        return s

    def grow(self, s: Session, ids: list[int]) -> None:   # a committed step: new tokens on the device
        s.token_ids.extend(ids)
        while len(s.chunks) * BS < len(s.token_ids):
            s.chunks.append(Chunk(DEVICE, self.slot()))
        self.register(s)

    def register(self, s: Session) -> None:
        if self.full_walk:
            s.index_cursor = (-1, 0)
        self.sharing.register(s, lambda c: self.freed.append(c.loc))

    def refill(self, s: Session) -> None:                 # dropped chunks recomputed on the device
        for k, c in enumerate(s.chunks):
            if c.state is DROPPED:
                self.release(s, k)
                s.chunks[k] = Chunk(DEVICE, self.slot())
        self.register(s)

    def drop(self, s: Session, k: int) -> None:          # Placement.drop: unshare, then drop
        for h, j in self.sharing.unshare([(s, k)]):
            self.freed.append(h.chunks[j].loc)
            h.chunks[j].assign(DROPPED)

    def truncate(self, s: Session, length: int) -> None:  # History.truncate
        keep = -(-length // BS)
        for k in range(keep, len(s.chunks)):
            self.release(s, k)
        del s.chunks[keep:]
        if length % BS and not self.sharing.privatize(s, keep - 1):
            self.release(s, keep - 1)
        del s.token_ids[length:]

    def snapshot(self) -> tuple:
        """Everything register decides, by value: each chunk's place and entry, the index."""
        def entry(c: Chunk):
            e = c.entry
            return None if e is None else (e.key, e.depth, sorted(e.holders), e in self.sharing.index)
        chunks = {sid: [(c.state, c.loc, entry(c)) for c in s.chunks] for sid, s in self.sessions.items()}
        index = sorted((e.key, e.depth, sorted(e.holders), e.payload.loc) for e in self.sharing.index.entries())
        return chunks, index, sorted(x for x in self.freed if x is not None)

    def check(self) -> None:
        check_sharing(list(self.sessions.values()), self.sharing.index, BS, self.sharing.epoch)


def _random_ops(seed: int, n: int = 400):
    rng = random.Random(seed)
    for _ in range(n):
        sid = f"s{rng.randrange(5)}"
        op = rng.choice(["grow", "grow", "grow", "drop", "withdraw", "truncate", "refill", "delete"])
        yield op, sid, rng.random(), [rng.randrange(3, 6) for _ in range(rng.randrange(1, 2 * BS))]


def _apply(w: World, op: str, sid: str, r: float, ids: list[int]) -> None:
    s = w.sessions.get(sid)
    if s is None:
        s = w.open(sid, SYSTEM[: int(r * len(SYSTEM))] + ids)
        w.grow(s, (SYSTEM[: int(r * len(SYSTEM))] + ids)[len(s.token_ids):])
        return
    full = len(s.token_ids) // BS
    if op == "grow":
        w.grow(s, ids)
    elif op == "drop" and s.chunks:
        w.drop(s, int(r * len(s.chunks)))
    elif op == "withdraw" and full:
        w.sharing.withdraw(s, int(r * full))
    elif op == "truncate":
        w.truncate(s, int(r * len(s.token_ids)))
    elif op == "refill":
        w.refill(s)
    elif op == "delete":
        w.truncate(s, 0)
        del w.sessions[sid]


@pytest.mark.parametrize("seed", range(12))
def test_incremental_register_matches_a_full_walk(seed):
    full, incremental = World(full_walk=True), World(full_walk=False)
    shared = skipped = 0            # the run shares chunks, and registers start past chunk 0
    for op in _random_ops(seed):
        skipped += sum(s.index_cursor[1] for s in incremental.sessions.values()
                       if s.index_cursor[0] == incremental.sharing.epoch)
        _apply(full, *op)
        _apply(incremental, *op)
        incremental.check()
        assert incremental.snapshot() == full.snapshot(), op
        shared += any(len(e.holders) > 1 for e in incremental.sharing.index.entries())
    assert shared > 20 and skipped > 100, (shared, skipped)


def test_a_chunk_that_left_the_index_with_its_parent_is_indexed_again():
    w = World(full_walk=False)
    a = w.open("a", SYSTEM)
    w.grow(a, SYSTEM)
    b = w.open("b", SYSTEM + [3])
    w.grow(b, [3])
    assert b.chunks[:6] == a.chunks[:6] and len(w.sharing.index) == 6
    assert a.index_cursor[1] == 6
    w.sharing.withdraw(a, 1)                 # chunks 1-5 leave the index; a and b keep them, shared
    assert len(w.sharing.index) == 1
    w.check()
    w.register(a)                            # a walk from the cursor (6) would index nothing
    assert len(w.sharing.index) == 6
    assert [e.payload for e in w.sharing.index.match(a.scope, SYSTEM)] == a.chunks[:6]
    assert all(c.entry.holders == {"a", "b"} for c in a.chunks[:6])
    w.check()


def test_a_stale_cursor_is_caught_by_the_check():
    w = World(full_walk=False)
    a = w.open("a", SYSTEM)
    w.grow(a, SYSTEM)
    epoch, n = a.index_cursor
    w.sharing.withdraw(a, 3)
    a.index_cursor = (w.sharing.epoch, n)    # what a missing epoch bump would leave
    with pytest.raises(AssertionError, match="not indexed"):
        w.check()
