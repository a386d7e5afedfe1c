"""The store's integrity check: every slot of every tier is free or owned by exactly one chunk, and
shared chunks agree with their holders and the prefix index. Read-only (but for the table's pruning of
its device sessions); the caller holds the store lock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ...kernels.blocks import blocks_for
from ..pools.tier_pools import TierPools, count_chunks, device_room
from ..prefix.index import PrefixIndex
from ..sessions.session import SHADOWED, ChunkState, Session, SessionTable
from ..sessions.tenant import tenant_of

DEVICE, HOST, DROPPED, LAYERED = ChunkState.DEVICE, ChunkState.HOST, ChunkState.DROPPED, ChunkState.LAYERED
HIDDEN, DISK, DISK_HIDDEN = ChunkState.HIDDEN, ChunkState.DISK, ChunkState.DISK_HIDDEN


def check_integrity(sessions: SessionTable, tiers: TierPools, block_size: int) -> None:
    """Raise AssertionError unless every slot of every tier is free or owned by exactly one chunk,
    chunk tables match token counts, and only HOST/HIDDEN chunks have shadows. A residue block
    (layerwise_kv) is owned per residue by distinct LAYERED chunks, each naming the block's factor,
    and by nothing else. A disk slot is owned by one chunk object; the disk index's rows naming it
    (one per holder of a shared chunk) all name that object, at one chunk index, with one checksum.
    Shared chunks agree with their holders and the prefix index (`check_sharing`). The table's
    `device_chunks()` are exactly the chunks holding device blocks, once each (`shadow_chunks()` those keeping
    a shadow), its `retained()` the retained ones,
    its `busy()` the busy ones; the room's device blocks (`device_room`, from the pool's count) are
    the free blocks and the idle sessions' device chunks and shadows counted one by one.
    A chunk held in two tiers (served from above, with a disk copy: `disk/copies.py`) counts its disk
    slot as the copy's, owned by nothing else, with a checksum (a copy being written: none yet); the
    index names it only while the copy is valid (`DiskState.session_rows`, compared by `check`)."""
    owners: dict[ChunkState, dict[int, tuple[str, int]]] = {DEVICE: {}, HOST: {}, HIDDEN: {}, DISK: {}, DISK_HIDDEN: {}}

    def own(tier, slot, who):
        pool = tiers.pool(tier)
        assert pool is not None, f"{who} is {tier.value} but the store has no such tier"
        assert 0 <= slot < pool.num_blocks, f"{who}: {tier.value} slot {slot} out of range"
        assert slot not in owners[tier], f"{tier.value} slot {slot} owned by {owners[tier][slot]} and {who}"
        owners[tier][slot] = who

    holding = {id(c): (s.session_id, k) for s in sessions for k, c in enumerate(s.chunks) if c.holds_device}
    listed = [id(s.chunks[k]) for s, k in sessions.device_chunks()]
    assert len(listed) == len(set(listed)), "device_chunks names a chunk twice"
    shadows = [id(s.chunks[k]) for s, k in sessions.shadow_chunks()]
    assert len(shadows) == len(set(shadows)) and set(shadows) == {
        id(c) for s in sessions for c in s.chunks if c.shadow is not None}, "shadow_chunks: not the shadows kept"
    assert set(holding) == set(listed), (f"chunks holding device blocks {sorted(holding.values())[:8]} != "
                                         f"device_chunks ({len(listed)})")
    _check_tiers(sessions)
    _check_usage(sessions, block_size)
    retained = {s.session_id for s in sessions if s.retained}
    assert retained == {s.session_id for s in sessions.retained()}, f"retained sessions {sorted(retained)}"
    busy = {s.session_id for s in sessions if s.busy}
    assert busy == {s.session_id for s in sessions.busy()}, f"busy sessions {sorted(busy)[:8]} != the table's"
    idle = [s.session_id for s in sessions if not s.busy and not s.retained]
    assert sorted(idle) == sorted(sessions.idle_ids()), "the table's idle order lists other sessions"
    held: dict[tuple[int, int], tuple[tuple[str, int], int]] = {}   # (block, residue) -> (who, factor)
    seen: set[int] = set()          # chunk objects counted: a prefix-shared chunk is one object in many tables
    for s in sessions:
        n_chunks = blocks_for(len(s.token_ids), block_size)
        assert len(s.chunks) == n_chunks, f"{s.session_id}: {len(s.chunks)} chunks for {len(s.token_ids)} tokens"
        for k, c in enumerate(s.chunks):
            who = (s.session_id, k)
            if id(c) in seen:       # its holders against the index: check_sharing
                assert c.entry is not None, f"{who}: one chunk object in two places, not a shared one"
                continue
            seen.add(id(c))
            if c.state is DROPPED:
                assert c.loc is None and c.shadow is None, (who, c)
            else:
                assert c.loc is not None, (who, c)
                own(HOST if c.state is LAYERED else c.state, c.loc, who)
            if c.residue_block is not None:
                assert c.state is LAYERED, f"{who}: only layered chunks hold a residue block, {c}"
                block, factor, residue = c.residue_block
                assert 0 <= residue < factor, (who, c)
                assert (block, residue) not in held, f"residue {residue} of block {block} owned twice"
                held[block, residue] = (who, factor)
            if c.shadow is not None:
                assert c.state in SHADOWED, f"{who}: only host/hidden chunks keep a device shadow, {c}"
                own(DEVICE, c.shadow, who)
            if c.source is not None:
                assert c.state is DEVICE, f"{who}: only device chunks are rebuilt from a hidden slot, {c}"
                assert c.source[0] in (HIDDEN, DISK_HIDDEN), f"{who}: not a hidden form {c}"
                own(c.source[0], c.source[1], who)
    listed = set()
    for block, (factor, slots) in (tiers.residues.blocks.items() if tiers.residues is not None else ()):
        assert any(o is not None for o in slots), f"residue block {block} has no owner and is not freed"
        for r, o in enumerate(slots):
            if o is not None:
                assert held.get((block, r)) == (o, factor), (
                    f"residue block {block} residue {r}: table says {o} (factor {factor}), "
                    f"chunks say {held.get((block, r))}")
                listed.add((block, r))
        own(DEVICE, block, ("residue block", block))
    assert listed == set(held), f"residues not in the table: {sorted(set(held) - listed)[:4]}"
    pending: set[int] = set()
    if tiers.disk is not None:            # a chunk held in two tiers: its disk copy's slot is the copy's alone
        copies = tiers.disk_state.copies
        pending = set(copies.pending)
        for slot in copies.slots() | pending:
            own(DISK, slot, ("disk copy", slot))
        _check_disk_rows(sessions, tiers)
        tiers.disk_state.check()
    check_sharing(list(sessions), tiers.sharing.index, block_size, tiers.sharing.epoch)
    unmarked = [s.session_id for s in sessions if s.session_id not in tiers.sharing.sharers
                and any(c.shared for c in s.chunks)]
    assert not unmarked, f"sessions holding shared chunks, not among the sharers: {unmarked[:4]}"
    for tier, owned in owners.items():
        pool = tiers.pool(tier)
        if pool is not None:
            try:
                pool.check(set(owned), pending) if tier is DISK else pool.check(set(owned))
            except AssertionError as e:
                raise AssertionError(f"{tier.value} tier: {e}") from None
    counted = tiers.device.num_free + count_chunks(sessions, DEVICE, tiers.sharing, shadows=True, idle_only=True)
    derived = device_room(tiers, sessions.busy())     # (after the slots: a block neither free nor owned is theirs)
    assert derived == counted, f"room: {derived} device blocks from the pool's count, {counted} counted"


def _check_disk_rows(sessions: SessionTable, tiers: TierPools) -> None:
    """The rows the disk index would commit now: those naming one (form, slot) name one chunk object
    (each row's session holds it at that k) with the slot's checksum."""
    _, rows = tiers.disk_state.rows()
    named: dict[tuple[str, int], tuple[int, int, int]] = {}       # (form, slot) -> (id(chunk), k, checksum)
    for (sid, k), (form, slot, checksum) in rows.items():
        c = sessions.get(sid).chunks[k]
        first = named.setdefault((form, slot), (id(c), k, checksum))
        assert first == (id(c), k, checksum), (
            f"{form} disk slot {slot} named by ({sid!r}, {k}) and by another chunk, index or checksum")


def check_sharing(sessions: Sequence[Session], index: PrefixIndex, block_size: int, epoch: int | None = None) -> None:
    """Raise AssertionError unless holders and chunks agree (`prefix/sharing.py`'s rules): a chunk with
    an entry is that entry's payload, at the entry's depth in exactly its holders, full, never
    DROPPED (it may be on disk), and its holders' ids agree up to its end (its KV, and a disk slot's
    checksum, depend on them); an indexed entry's payload names it; the index's own rules hold.
    With the sharing part's `epoch`: every `Session.index_cursor` of that epoch is true (its chunks
    before the cursor are full and indexed: what lets `PrefixSharing.register` start there)."""
    index.check()
    seen: dict[int, set[str]] = {}
    prefix: dict[int, list[int]] = {}
    bs = block_size
    for s in sessions:
        for k, c in enumerate(s.chunks):
            if c.entry is None:
                continue
            e = c.entry
            who = (s.session_id, k)
            assert e.payload is c and e.depth == k, f"{who}: chunk and entry disagree"
            assert s.session_id in e.holders, f"{who}: holds a shared chunk it is not a holder of"
            assert len(s.token_ids) >= (k + 1) * bs, f"{who}: a shared chunk must be full"
            assert tuple(s.token_ids[k * bs:(k + 1) * bs]) == e.ids, f"{who}: ids differ from its entry's"
            assert c.state is not DROPPED, f"{who}: shared chunk is {c.state.value}"
            first = prefix.setdefault(id(e), s.token_ids[: (k + 1) * bs])
            assert first == s.token_ids[: (k + 1) * bs], f"{who}: holders of one chunk with other prefixes"
            seen.setdefault(id(e), set()).add(s.session_id)
    for s in sessions:
        for c in s.chunks:
            if c.entry is not None:
                held = sorted(seen[id(c.entry)])
                assert set(held) == c.entry.holders, (
                    f"chunk {c.entry.depth}: holders {sorted(c.entry.holders)} but held by {held}")
    for e in index.entries():
        assert e.payload.entry is e, f"indexed chunk {e.depth} does not name its entry"
        assert e.holders, f"indexed chunk {e.depth} has no holder"
    for s in sessions if epoch is not None else ():
        at, n = s.index_cursor
        if at == epoch:
            assert n <= len(s.token_ids) // bs, f"{s.session_id!r}: index cursor {n} past its full chunks"
            for k in range(n):
                e = s.chunks[k].entry
                assert e is not None and e in index, f"{s.session_id!r}: chunk {k} < index cursor {n} is not indexed"


def _check_tiers(sessions: SessionTable) -> None:
    """Every session holding a chunk of its own in an indexed tier is listed there (`tier_index.TierOrder`):
    an idle one under its current entry, a busy one (re-keyed when its lease ends) under any; every entry is
    keyed. A shared chunk there has its tops, the most valuable of its holders' keys per list, and they are
    listed there (per tenant: in its holders' tenant's lists); no tops are kept for any other chunk."""
    index = sessions.tiers
    tops = {}
    for s in sessions:
        kept = index.key.get(s.session_id)
        for st in index.order:
            if any(c.state is st and not c.shared for c in s.chunks):
                assert kept is not None and index.listed(st, kept[1], kept[0]), (
                    f"session {s.session_id!r} holds {st.value} chunks, unlisted")
        assert s.busy or kept is None or kept == index.entry(s), f"session {s.session_id!r} listed under {kept}"
        for c in s.chunks:
            if c.state in index.order and c.shared:
                h = kept if kept is not None else index.entry(s)
                best = tops.setdefault(id(c), (c, [None, None]))[1]
                if best[h[0]] is None or h[1] > best[h[0]]:
                    best[h[0]] = h[1]
    assert set(index.tops) == set(tops), f"{len(index.tops)} shared chunks' tops kept, {len(tops)} shared chunks"
    for cid, (c, best) in tops.items():
        t = index.tops[cid]
        assert t.chunk is c and t.state is c.state and t.top == best, (
            f"a shared {c.state.value} chunk's tops {t.top} != its holders' {best}")
        assert len({tenant_of(h) for h in c.entry.holders}) == 1, f"a chunk shared across tenants: {c.entry.holders}"
        for expected, e in enumerate(best):
            assert e is None or index.listed(c.state, e, bool(expected)), f"{e[1]!r} tops a shared chunk, unlisted"
            assert e is None or cid in index.topping.get(e[1], ()), f"{e[1]!r} tops a shared chunk, not marked so"
    assert all(cid in index.tops and index.tops[cid].names(sid) for sid, ids in index.topping.items() for cid in ids)
    for lists, expected in ((index.order, False), (index.ahead, True)):
        for per in lists.values():
            for t, lst in per.items():
                assert all(index.key.get(e[1]) == (expected, e) and index.group(e[1]) == t for e in lst)
                assert not expected or not lst or index.soonest <= -lst[-1][0], "a lapse due is skipped"


def _check_usage(sessions: SessionTable, block_size: int) -> None:
    """The table's incremental token counts per (state, tenant) equal a full count."""
    full: Counter[tuple[ChunkState, str]] = Counter()
    live: Counter[tuple[ChunkState, str]] = Counter()
    for s in sessions:
        for st, n in s.tokens_by_state(block_size).items():
            full[(st, tenant_of(s.session_id))] += n
            if not s.retained:
                live[(st, tenant_of(s.session_id))] += n
    assert dict(sessions.usage()) == dict(+full), f"usage counts {dict(sessions.usage())} != {dict(+full)}"
    by_state: Counter[ChunkState] = Counter()
    for (st, _), n in full.items():
        by_state[st] += n
    assert +Counter(sessions.totals()) == +by_state, f"token totals {dict(sessions.totals())} != {dict(by_state)}"
    assert dict(sessions.live_usage()) == dict(+live), f"live usage {dict(sessions.live_usage())} != {dict(+live)}"
    extra: Counter[ChunkState] = Counter()       # what `stats()` subtracts for the shared chunks, by a full walk
    shared, seen = 0, set()
    for s in sessions:
        for k, c in enumerate(s.chunks):
            if c.shared and id(c) not in seen:
                seen.add(id(c))
                extra[c.state] += s.chunk_len(k, block_size) * (len(c.entry.holders) - 1)
                shared += s.chunk_len(k, block_size)
    got_extra, got_shared = sessions.shared_tokens()
    assert (+Counter(got_extra), got_shared) == (+extra, shared), (
        f"shared chunks' extra holders {dict(got_extra)}, {got_shared} tokens != {dict(extra)}, {shared}")
    per_tenant = Counter(tenant_of(s.session_id) for s in sessions if not s.retained)
    assert sessions.live_sessions_per_tenant() == per_tenant, "live sessions per tenant"
