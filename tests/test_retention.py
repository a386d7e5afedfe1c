"""Retention through tool pauses (`KVStore.expect`, a hint's `expected_arrival`): every policy ranks a
session by its estimated next use (`Session.next_use`): its expected turn while that is ahead, else as
far from now as its last activity is; the furthest goes down first (Belady's rule on an estimate), in
every tier. A priority: it lapses when its time passes, it is clamped to `max_retain`, and it never
pins (room is still made from it when nothing else is left). Every turn equals stateless greedy
generate; `check_integrity` after every operation."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, greedy

from stateful_hf import Engine, SessionStore
from stateful_hf.cache import ChunkState

BS = 8
MODEL, ORACLE = FAMILIES["llama"](), FAMILIES["llama"]()
HOST = ChunkState.HOST


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompt(i: int) -> torch.Tensor:
    return torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(i))


def held_on_host(policy: str = "recency_cost", **kw):
    """Sessions a, b, c (active at t = 1, 2, 3), their KV on the host."""
    clock = Clock()
    store = SessionStore(MODEL, 4096, host_capacity=4096, chunk_size=BS, clock=clock, policy=policy, **kw)
    for i, sid in enumerate("abc"):
        clock.now = i + 1.0
        out = greedy(MODEL, prompt(i), n=2, cache=store.cache(sid))
        assert torch.equal(out, greedy(ORACLE, prompt(i), n=2))
        store.move(sid, range(len(store.places(sid))), "host")
        store.check_integrity()
    return store, clock


def order(store) -> list[str]:
    """Sessions in the order their host chunks would go down (the walk and the full scan agree)."""
    walked = [s.session_id for s, _ in store.placement.victims(HOST, 10 ** 6, set())]
    assert walked == [s.session_id for s, _ in store.placement.victims(HOST, 10 ** 6, set(), scan=True)]
    return list(dict.fromkeys(walked))


@pytest.mark.parametrize("policy", ["lru", "recency_cost", "pensieve", "return_aware"])
def test_the_furthest_next_use_goes_first_and_an_expectation_lapses(policy):
    store, clock = held_on_host(policy)
    clock.now = 4.0
    assert order(store) == ["a", "b", "c"]               # negative control: least recently active first
    store.expect("a", 0.5)                               # back at 4.5: before b (guessed 6) and c (5)
    store.check_integrity()
    assert order(store) == ["b", "c", "a"]
    store.expect("b", 0.2)                               # b back at 4.2, a at 4.5: the later goes first
    assert order(store) == ["c", "a", "b"]
    store.expect("c", 60.0)                              # a long tool call: c goes first
    assert order(store) == ["c", "a", "b"] and store.session("c").expected_at == 64.0
    store.check_integrity()
    clock.now = 12.0                                     # a's and b's times passed: they lapse
    greedy(MODEL, prompt(2), n=2, cache=store.cache("c"))     # c came back at 12 (its expectation is met)
    store.move("c", range(len(store.places("c"))), "host")
    assert order(store) == ["a", "b", "c"] and store.session("a").expected_at == 0.0
    assert store.session("c").expected_at == 0.0
    store.check_integrity()
    store.close()


def test_retention_is_clamped_and_never_pins():
    store, clock = held_on_host(max_retain=2.0)
    store.expect("a", 10 ** 6)                           # clamped: back at t = 3 + 2
    assert store.session("a").expected_at == 5.0
    store.expect("a", 0.5)                               # back at 3.5: after b (guessed 4), before c (3)
    assert order(store) == ["b", "a", "c"]
    store.move("b", range(len(store.places("b"))), "dropped")
    store.move("c", range(len(store.places("c"))), "dropped")
    host = store.tiers.host
    want = host.num_blocks                               # every host block: only a's are left to take
    with store.lock:
        host.free(store.placement.take(HOST, want, set()))
    assert store.residency("a")["host"] == 0             # it was taken: a priority, not a pin
    out = greedy(MODEL, prompt(0), n=2, cache=store.cache("a"))
    assert torch.equal(out, greedy(ORACLE, prompt(0), n=2))
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "5", True])
def test_a_bad_expectation_is_refused_and_changes_nothing(bad):
    store, _ = held_on_host()
    with pytest.raises(ValueError, match="seconds"):
        store.expect("a", bad)
    assert store.session("a").expected_at == 0.0 and order(store) == ["a", "b", "c"]
    store.close()


def test_a_hint_with_expected_arrival_retains():
    store, clock = held_on_host()
    engine = Engine(MODEL, store=store)
    h = engine.hint("a", expected_arrival=30.0)
    h.wait(30)
    assert store.session("a").expected_at == 33.0
    assert engine.hint("nobody", expected_arrival=1.0).wait(30)       # unknown: the hint says so, no error
    with pytest.raises(ValueError):
        engine.hint("a", expected_arrival=-1.0)
    engine.stop()
    store.check_integrity()
    store.close()
