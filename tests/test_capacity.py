"""What a step could get (`Capacity`, stateful_hf/cache/pools/tier_pools.py): `room().device_blocks` /
`available_host_blocks` against a reference computed from the chunk tables alone (a chunk object
held by several sessions is one block, and counts only when every session holding it is idle), with
shared prefixes, busy holders and chunks moved to the host. Exactness of the turns is checked
against stateless greedy generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import FAMILIES, greedy

from stateful_hf.cache import ChunkState

BS = 8
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(11))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


def reference(store, states, shadows: bool) -> int:
    """Blocks of chunks in `states` (or cached on the device, with `shadows`) whose every holder is
    idle, each physical chunk once: holders found by identity across every session's table."""
    holders: dict[int, list] = {}
    chunks: dict[int, object] = {}
    for s in store.sessions:
        for c in s.chunks:
            holders.setdefault(id(c), []).append(s)
            chunks[id(c)] = c
    return sum(1 for i, c in chunks.items()
               if (c.state in states or (shadows and c.shadow is not None))
               and not any(h.busy for h in holders[i]))


def check(store) -> None:
    store.check_integrity()
    assert store.room().device_blocks == store.free_blocks() + reference(store, {ChunkState.DEVICE}, True)
    assert store.available_host_blocks() == store.tiers.host.num_free + reference(store, {ChunkState.HOST}, False)


@pytest.fixture
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def test_available_blocks_count_a_shared_chunk_once_and_only_with_every_holder_idle(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS)
    for i, sid in enumerate("abc"):
        ids = torch.cat([SYSTEM, user(i)], 1)
        assert torch.equal(greedy(model, ids, cache=store.cache(sid)), greedy(oracle, ids))
    assert store.stats().shared_tokens == 40        # the 5 full chunks of the system prompt, held by a, b, c
    check(store)
    idle_all = store.room().device_blocks
    with store.lease("a"):                         # a busy holder: the shared chunks do not count
        check(store)
        own_a = len(store.session("a").chunks) - 5
        assert store.room().device_blocks == idle_all - own_a - 5
        with store.lease("b"):
            check(store)
    check(store)
    assert store.room().device_blocks == idle_all
    store.move("c", range(5, len(store.session("c").chunks)), "host")   # c's own chunks; the shared stay
    check(store)
    with store.lease("c"):                         # c's host chunks are busy, the shared ones too
        check(store)
        assert store.available_host_blocks() == store.tiers.host.num_free
    store.move("a", range(len(store.session("a").chunks)), "host")     # a shared chunk moves for all holders
    check(store)
    with contextlib.ExitStack() as stack:
        for sid in "abc":
            stack.enter_context(store.lease(sid))
        check(store)
        assert store.room().device_blocks == store.free_blocks()
    ids = torch.cat([SYSTEM, user(1), user(9)], 1)                       # b continues, exactly
    assert torch.equal(greedy(model, ids, cache=store.cache("b")), greedy(oracle, ids))
    check(store)


def test_the_device_room_reads_only_busy_sessions_and_a_stale_count_is_caught(models, make_store, monkeypatch):
    """`room().device_blocks` comes from the device pool's count less what busy sessions hold (`device_room`,
    kept with the table's busy set, `SessionTable.busy`): it reads no idle session, however many are on the
    device, and equals the count from the chunk tables (`check_integrity` compares them, after every step in
    tests/test_layerwise.py with LayerKV's residue blocks open). Negative controls: a busy flag set behind the
    table's back, and a room figure left stale by a lease, each fail `check_integrity`."""
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=256, chunk_size=BS)
    for i, sid in enumerate("abcd"):
        ids = torch.cat([SYSTEM, user(i)], 1)
        assert torch.equal(greedy(model, ids, cache=store.cache(sid)), greedy(oracle, ids))
    check(store)
    table = type(store.sessions)
    with monkeypatch.context() as m:           # the room walks neither the table nor its device sessions
        for name in ("__iter__", "device_chunks"):
            m.setattr(table, name, lambda self, name=name: pytest.fail(f"room() called {name}"))
        free = store.room().device_blocks
        with store.lease("a"):
            assert [s.session_id for s in store.sessions.busy()] == ["a"]
            assert store.room().device_blocks == free - len(store.session("a").chunks)
    check(store)
    s = store.session("b")
    s.busy = True                              # not through the table's lease: its busy set is stale
    with pytest.raises(AssertionError, match="busy sessions"):
        store.check_integrity()
    s.busy = False
    store.check_integrity()
    from stateful_hf.cache.audit import integrity
    stale = store.room().device_blocks         # a figure not updated when a lease makes c's blocks busy
    monkeypatch.setattr(integrity, "device_room", lambda tiers, busy: stale)
    with store.lease("c"), pytest.raises(AssertionError, match="device blocks from the pool's count"):
        store.check_integrity()
    store.check_integrity()                    # c idle again: that figure is true again
    monkeypatch.undo()
    ids = torch.cat([SYSTEM, user(2), user(5)], 1)
    assert torch.equal(greedy(model, ids, cache=store.cache("c")), greedy(oracle, ids))
    check(store)
