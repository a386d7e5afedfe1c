"""The store alone (no transformers): blocks, steps, truncation, eviction order, integrity, errors."""

from __future__ import annotations

import pytest
import torch

from stateful_hf.cache import (
    CapacityError,
    ChunkState,
    CostProfile,
    KVSpec,
    KVStore,
    LRUPolicy,
    RetentionPolicy,
    SessionBusyError,
    UnknownSessionError,
    capacity_in_blocks,
)

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)


def new_store(capacity=32, **kw) -> KVStore:
    return KVStore(SPEC, capacity, **kw)


def idle_for(store, sid, seconds):
    """Make `sid` look idle `seconds` longer, through the one writer of `last_active` (its tier entry follows)."""
    s = store.session(sid)
    store.sessions.touch(s, s.last_active - seconds)


def append(store, sid, ids):
    n = store.open(sid).num_tokens
    step = store.plan_step([(sid, ids, range(n, n + len(ids)))])
    store.commit(step)
    return step


def test_capacity_parsing():
    assert capacity_in_blocks(10, SPEC) == 3
    assert SPEC.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert capacity_in_blocks("1KiB", SPEC) == 1024 // SPEC.bytes_per_block
    assert capacity_in_blocks("0.5 MB", SPEC) == 500_000 // SPEC.bytes_per_block
    for bad in ("lots", "1 parsec", 0, -3, 1.5):
        with pytest.raises((ValueError, TypeError)):
            capacity_in_blocks(bad, SPEC)


def test_step_writes_slots_and_tables():
    store = new_store()
    step = append(store, "a", list(range(10)))
    s = store.session("a")
    assert list(s.token_ids) == list(range(10)) and len(s.chunks) == 3
    blocks = [c.block for c in s.chunks]
    assert step.slots.tolist() == [blocks[p // 4] * 4 + p % 4 for p in range(10)]
    assert step.paged.kv_len.tolist() == [10] and step.paged.block_table[0].tolist() == blocks
    step = append(store, "a", [7, 8])
    assert step.paged.q_pos.tolist() == [10, 11] and step.slots.tolist()[0] == blocks[2] * 4 + 2
    store.check_integrity()


def test_abort_restores_exactly():
    store = new_store()
    append(store, "a", list(range(6)))
    s = store.session("a")
    before = (list(s.token_ids), [c.block for c in s.chunks], store.free_blocks())
    step = store.plan_step([("a", [1, 2, 3, 4, 5], range(6, 11))])
    store.abort(step)
    s = store.session("a")
    assert (list(s.token_ids), [c.block for c in s.chunks], store.free_blocks()) == before
    store.check_integrity()


def test_truncate_frees_whole_chunks_only():
    store = new_store()
    append(store, "a", list(range(13)))
    free = store.free_blocks()
    assert store.truncate("a", 5) == 8
    assert list(store.session("a").token_ids) == list(range(5)) and len(store.session("a").chunks) == 2
    assert store.free_blocks() == free + 2
    assert store.truncate("a", 9) == 0
    store.check_integrity()


def test_eviction_takes_idle_sessions_leading_chunks_first():
    store = new_store(capacity=16)                  # 4 blocks
    append(store, "old", list(range(8)))            # 2 blocks
    append(store, "new", list(range(8)))            # 2 blocks
    idle_for(store, "old", 100.0)       # idler
    append(store, "x", [1, 2, 3, 4])                # needs 1 block: evicts old's leading chunk
    old = store.session("old")
    assert [c.state for c in old.chunks] == [ChunkState.DROPPED, ChunkState.DEVICE]
    assert store.missing_positions("old") == [0, 1, 2, 3]
    store.check_integrity()


def test_recompute_dropped_chunks_in_a_step():
    store = new_store(capacity=16)
    append(store, "a", list(range(10)))
    idle_for(store, "a", 50)
    append(store, "b", list(range(12)))             # evicts a's leading chunks
    missing = store.missing_positions("a")
    assert missing
    with pytest.raises(ValueError, match="must be recomputed"):
        store.plan_step([("a", [5], [10])])         # cannot attend to dropped chunks
    with pytest.raises(ValueError, match="history has"):
        store.plan_step([("a", [99] * len(missing), missing)])
    hist = store.session("a").token_ids
    step = store.plan_step([("a", [hist[p] for p in missing] + [42], missing + [10])])
    assert step.paged.q_pos.tolist() == missing + [10]
    store.commit(step)
    assert store.missing_positions("a") == [] and store.session("a").token_ids[-1] == 42
    store.check_integrity()


def test_request_larger_than_pool_is_refused_without_change():
    store = new_store(capacity=8)
    append(store, "a", [1, 2, 3])
    with pytest.raises(CapacityError, match="in all"):
        store.plan_step([("a", list(range(20)), range(3, 23))])
    assert list(store.session("a").token_ids) == [1, 2, 3]
    store.check_integrity()


def test_busy_sessions_are_not_evicted():
    store = new_store(capacity=8)                   # 2 blocks
    append(store, "a", list(range(8)))
    with store.lease("a"):
        with pytest.raises(SessionBusyError), store.lease("a"):
            pass
        with pytest.raises(CapacityError, match="busy"):
            append(store, "b", [1])
    assert store.session("a").tokens_in(ChunkState.DEVICE, 4) == 8
    append(store, "b", [1])                         # idle now: evictable
    store.check_integrity()


def test_errors_leave_store_intact():
    store = new_store()
    append(store, "a", [1, 2])
    with pytest.raises(UnknownSessionError):
        store.session("nobody")
    with pytest.raises(UnknownSessionError):
        store.plan_step([("nobody", [1], [0])])
    with pytest.raises(ValueError):
        store.plan_step([("a", [], [])])
    with pytest.raises(ValueError, match="without gaps"):
        store.plan_step([("a", [1], [5])])
    with pytest.raises(ValueError, match="one entry per session"):
        store.plan_step([("a", [1], [2]), ("a", [1], [3])])
    with pytest.raises(ValueError):
        store.open("")
    assert list(store.session("a").token_ids) == [1, 2]
    store.check_integrity()


def test_integrity_catches_corruption():
    store = new_store()
    append(store, "a", list(range(6)))
    store.tiers.device.free([store.session("a").chunks[0].block])
    with pytest.raises(AssertionError, match="both free and owned"):
        store.check_integrity()


def test_virtual_clock_decides_idle_time():
    """The store stamps activity with its `clock`, and eviction ranks by that clock's idle time: with
    a virtual clock the order follows virtual time, whatever the wall clock does."""
    now = [100.0]
    store = new_store(capacity=16, clock=lambda: now[0], policy=LRUPolicy())   # 4 blocks
    append(store, "b", list(range(8)))              # active at 100
    now[0] = 50.0                                   # the clock may be anything: "a" is older by it
    append(store, "a", list(range(8)))
    assert store.session("a").last_active == 50.0 and store.session("b").last_active == 100.0
    now[0] = 200.0
    append(store, "x", [1, 2, 3, 4])                # evicts the session idle longest by the clock: "a"
    assert [c.state for c in store.session("a").chunks] == [ChunkState.DROPPED, ChunkState.DEVICE]
    assert all(c.state is ChunkState.DEVICE for c in store.session("b").chunks)
    assert store.session("x").last_active == 200.0
    store.check_integrity()


def test_policies_order():
    store = new_store(capacity=64)
    append(store, "idle", list(range(12)))
    append(store, "recent", list(range(12)))
    idle_for(store, "idle", 1000)
    idle_for(store, "recent", 1)
    sessions = [store.session("recent"), store.session("idle")]
    now = store.session("recent").last_active + 1
    def order(policy):
        ranked = sorted(((s, k) for s in sessions for k in range(len(s.chunks))),
                        key=lambda sk: policy.key(sk[0], sk[1], 4, now))
        return [(s.session_id, k) for s, k in ranked]

    assert order(RetentionPolicy())[:3] == [("idle", 0), ("idle", 1), ("idle", 2)]  # idler first, leading first
    assert order(LRUPolicy())[0] == ("idle", 0)
    prof = CostProfile()
    assert prof.cost(64) < prof.cost(1000) < prof.cost(10_000)


def test_stats():
    store = new_store()
    append(store, "a", list(range(6)))
    st = store.stats()
    assert st.device_tokens == 6 and st.dropped_tokens == 0 and st.sessions == 1
    assert st.kv_bytes_per_token == SPEC.bytes_per_token and st.device_bytes == 2 * SPEC.bytes_per_block
    assert store.stats("a").num_tokens == 6
    store.delete("a")
    assert store.free_blocks() == store.tiers.device.num_blocks
    assert torch.is_tensor(store.tiers.device.data)


def test_turn_stats_have_one_writer_the_store():
    """begin_turn cuts to the prompt's prefix and counts each tier; commits in the turn add their rows
    (recomputed history among them); add_generated sets the output; steps outside a turn count nowhere."""
    from stateful_hf.cache import StoreError
    store = new_store(64, host_capacity=64, swap_out_threshold=0.0)
    append(store, "a", list(range(20)))                      # chunks 0..4 on the device
    store.move("a", [1, 2], "host")
    store.move("a", [3], "dropped")
    with pytest.raises(StoreError, match="not leased"):
        store.begin_turn("a", list(range(20)))
    with store.lease("a"):
        turn = store.begin_turn("a", list(range(18)) + [99, 98])   # diverges at 18: 2 tokens cut
        assert store.session("a").last_turn is turn
        assert (turn.truncated_tokens, turn.reused_device, turn.swapped_in_host) == (2, 6, 8)
        assert turn.reused_tokens == 14 and turn.recomputed_tokens == turn.computed_tokens == 0
        missing = store.missing_positions("a")
        assert missing == [12, 13, 14, 15]
        step = store.plan_step([("a", [12, 13, 14, 15, 99, 98], missing + [18, 19])])
        store.abort(step)                                   # an aborted step counts nothing
        assert turn.computed_tokens == 0
        step = store.plan_step([("a", [12, 13, 14, 15, 99, 98], missing + [18, 19])])
        store.commit(step)
        assert (turn.computed_tokens, turn.recomputed_tokens) == (6, 4)
        store.add_generated("a", 1)
        assert turn.generated_tokens == 1
    append(store, "a", [5])                                 # no turn: last_turn stays the turn's
    assert store.stats("a").last_turn == turn and turn.computed_tokens == 6
    store.check_integrity()


@pytest.mark.parametrize("factor", [1, 0, 2])
def test_blocks_needed_is_what_plan_step_takes(factor):
    """`Capacity.blocks_needed` / `chunk_needs` (the parts' path) give plan_step's answer: the device
    blocks a step takes, for every mix of device, host and dropped chunks."""
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=4, block_size=4)
    store = KVStore(spec, 64, host_capacity=64, swap_out_threshold=0.0, layerwise_kv=factor != 1)
    append(store, "a", list(range(22)))                      # 6 chunks, the last one partial
    store.move("a", [1, 4], "host")
    store.move("a", [2], "dropped")
    s = store.session("a")
    needs = store.capacity.chunk_needs(s, 30, None, factor)
    assert needs.fills == [2, 6, 7]
    assert (needs.copies, needs.in_place) == (([], [1, 4]) if factor != 1 else ([1, 4], []))
    need = store.capacity.blocks_needed(s, 30, None, factor)
    assert need == {1: 5, 0: 0, 2: 2}[factor]
    free = store.free_blocks()
    with store.lease("a"):
        rows = [(p, s.token_ids[p]) for p in range(8, 12)] + [(p, 7) for p in range(22, 30)]
        step = store.plan_step([("a", [t for _, t in rows], [p for p, _ in rows])], factors=[factor])
        assert free - store.free_blocks() == need
        store.commit(step)
    store.check_integrity()
