"""A bound on what a store holds (`max_sessions`, `session_ttl`): past it the least recently active idle
sessions are forgotten whole when a lease ends, counted in `stats().counters.forgotten_sessions`. A
forgotten session's next turn is a new conversation, exact, and still reuses the prefix it shared;
a busy session is never forgotten; without a bound nothing is (the negative control)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, greedy, store_turn

from stateful_hf import Engine, SamplingParams

SYSTEM = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(3))     # 5 full chunks of 8


def user(seed: int, n: int = 6) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(100 + seed))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


@pytest.mark.parametrize("bound", [3, None])
def test_max_sessions_forgets_the_least_recently_active(models, make_store, bound):
    model, oracle = models
    store = make_store(model, 4096, chunk_size=8, max_sessions=bound)
    convs = {sid: store_turn(model, oracle, store, sid, torch.cat([SYSTEM, user(i)], 1), n=4)
             for i, sid in enumerate("abcd")}
    if bound is None:                                  # negative control: nothing forgotten
        assert store.session_ids() == list("abcd") and store.stats().counters.forgotten_sessions == 0
        return
    assert store.session_ids() == list("bcd") and store.stats().counters.forgotten_sessions == 1
    ids = torch.cat([convs["a"], user(9)], 1)           # a comes back: a new conversation, exact
    store_turn(model, oracle, store, "a", ids, n=4)
    turn = store.stats("a").last_turn
    assert turn.reused_tokens == 40 and turn.recomputed_tokens == 0   # the shared system prompt, not its own turn
    assert store.session_ids() == list("cda") and store.stats().counters.forgotten_sessions == 2


def test_session_ttl_forgets_idle_sessions_but_never_a_busy_one(models, make_store):
    model, oracle = models
    clock = Clock()
    store = make_store(model, 4096, chunk_size=8, session_ttl=10.0, clock=clock)
    store_turn(model, oracle, store, "old", torch.cat([SYSTEM, user(1)], 1), n=4)
    clock.now = 5.0
    store_turn(model, oracle, store, "busy", torch.cat([SYSTEM, user(2)], 1), n=4)
    clock.now = 12.0
    with store.lease("busy"):                          # "old" idle 12 s, "busy" 7 s: nothing ends yet
        clock.now = 30.0
        store.maintain()                               # "old" goes; "busy" is leased, so it stays
        assert store.session_ids() == ["busy"]
    assert store.session_ids() == ["busy"]             # released at 30: last active now
    clock.now = 41.0
    store.maintain()
    assert store.session_ids() == [] and store.stats().counters.forgotten_sessions == 2
    store.check_integrity()


def test_engine_passes_the_bound_to_its_store(models):
    model, oracle = models
    engine = Engine(model, device_capacity=4096, chunk_size=8, max_sessions=2)
    try:
        for i, sid in enumerate("xyz"):
            ids = torch.cat([SYSTEM, user(i)], 1)
            out = engine.submit(sid, ids[0].tolist(), SamplingParams(max_new_tokens=4)).result()
            assert list(out.token_ids) == greedy(oracle, ids, n=4)[0, ids.shape[1]:].tolist()
        assert engine.store.session_ids() == ["y", "z"]
        engine.store.check_integrity()
    finally:
        engine.stop()


@pytest.mark.parametrize(("name", "value"), [("max_sessions", 0), ("max_sessions", 1.5), ("session_ttl", -1),
                                             ("session_ttl", float("inf"))])
def test_bad_bounds_name_the_option(models, name, value):
    from stateful_hf import SessionStore
    with pytest.raises(ValueError, match=name):
        SessionStore(models[0], 64, **{name: value})
