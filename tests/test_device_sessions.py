"""The sessions a turn's device work looks at (`SessionTable.device_sessions`): exactly the sessions
holding a device block, kept without scanning the idle sessions held below, so that making room,
counting what a step could get and the ahead-of-time swap-out cost what the device holds, not what
the store holds. Over random schedules of turns (a shared system prompt among them), moves, deletes
and cuts: `check_integrity` (which asserts the set is exact), the device room against a count from
the chunk tables alone, and the eviction order against a full scan of every session (the oracle),
after every operation; every turn equals stateless greedy generate."""

from __future__ import annotations

import contextlib

import torch
from conftest import FAMILIES, greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_capacity import reference

from stateful_hf import CapacityError, SessionStore
from stateful_hf.cache import ChunkState

BS = 8
SYSTEM = torch.randint(3, 300, (1, 19), generator=torch.Generator().manual_seed(5))    # 2 full chunks + 3
IDS = ("a", "b", "c", "d", "e", "f")
MODEL, ORACLE = FAMILIES["llama"](), FAMILIES["llama"]()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def full_scan_victims(store, state: ChunkState, shadowed: bool | None) -> list[tuple[str, int]]:
    """What `Placement.victims` chose before it looked only at device sessions: every idle session's
    chunks in `state`, one per physical chunk, ranked by the policy's key over their holders."""
    sharing, bs = store.sharing, store.block_size
    now = store.clock.now
    store.policy.prepare(store.sessions, now)
    found = sharing.unique((s, k) for s in store.sessions if not s.busy for k, c in enumerate(s.chunks)
                           if c.state is state and (shadowed is None or (c.shadow is not None) == shadowed)
                           and sharing.free_to_move(c, set()))
    found.sort(key=lambda sk: max(store.policy.key(h, sk[1], bs, now) for h in sharing.holders(*sk)))
    return [(s.session_id, k) for s, k in found]


def check(store) -> None:
    store.check_integrity()                  # device_sessions() == the sessions holding device blocks
    assert store.available_blocks() == store.device_pool.num_free + reference(store, {ChunkState.DEVICE}, True)
    for state, shadowed in ((ChunkState.DEVICE, None), (ChunkState.HOST, True)):
        store.clock.now -= 1.0               # victims reads the clock once: the oracle's `now` is that one
        got = [(s.session_id, k) for s, k in store.placement.victims(state, 10 ** 6, set(), shadowed)]
        assert got == full_scan_victims(store, state, shadowed), (state, shadowed)


op = st.one_of(
    st.tuples(st.just("turn"), st.sampled_from(IDS), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("move"), st.sampled_from(IDS), st.sampled_from(["host", "device", "dropped"])),
    st.tuples(st.just("delete"), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("cut"), st.sampled_from(IDS), st.integers(0, 30)),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=4, max_size=14), st.integers(0, 2), st.sampled_from(["lru", "recency_cost"]))
def test_device_sessions_are_exact_and_eviction_matches_a_full_scan(ops, tight, policy):
    store = SessionStore(MODEL, [96, 160, 4096][tight], host_capacity=4096, chunk_size=BS, clock=Clock(),
                         policy=policy)
    convs: dict[str, torch.Tensor] = {}
    for o in ops:
        sid = o[1]
        exists = sid in store and store.num_tokens(sid) > 0
        if o[0] == "turn":
            _, _, n, system = o
            head = convs.get(sid, SYSTEM if system else torch.empty((1, 0), dtype=torch.long))
            ids = torch.cat([head, torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(n))], 1)
            out = greedy(MODEL, ids, n=3, cache=store.cache(sid))
            assert torch.equal(out, greedy(ORACLE, ids, n=3)), sid
            convs[sid] = out
        elif o[0] == "move" and exists:
            with contextlib.suppress(ValueError, CapacityError):   # dropped chunks cannot move up; a full tier
                store.move(sid, range(len(store.places(sid))), o[2])
        elif o[0] == "delete" and sid in store.session_ids():
            store.delete(sid, keep_shared=o[2])
            convs.pop(sid, None)
        elif o[0] == "cut" and exists:
            store.truncate(sid, min(o[2], store.num_tokens(sid)))
            convs[sid] = torch.tensor([store.token_ids(sid)], dtype=torch.long)
        check(store)
    store.close()
