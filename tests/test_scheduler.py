"""The scheduler's rules without a model: it is driven over the fake store (tests/fake_store.py, held to the real
store's contract by tests/test_store_contract.py), each step planned and committed through the door as the runner
does, the sampled token a fixed one. Admission order, suspension and resumption, warm-ups yielding, SLO deferral,
the reserve and the lease. (LayerKV's admission needs a host tier, which the fake has not: tests/test_layerwise.py.)"""

from __future__ import annotations

import itertools

from fake_store import FakeStore

from stateful_hf.engine.request import Request, RequestStatus
from stateful_hf.engine.sampling import SamplingParams
from stateful_hf.engine.scheduler import Scheduler, SchedulerConfig
from stateful_hf.engine.slo import SloPolicy

BS, TOKEN, EOS = 4, 7, frozenset({0})
_ids = itertools.count(1)


def request(sid: str, prompt: list[int], new: int = 3, warmup: bool = False, arrival: float | None = None) -> Request:
    r = Request(next(_ids), sid, list(prompt), SamplingParams(max_new_tokens=new), None, warmup=warmup)
    if arrival is not None:
        r.arrival = arrival
    return r


def step(s: Scheduler, store: FakeStore) -> list:
    """One engine step as the runner takes it: schedule, plan, commit, complete. Returns the items."""
    items = s.schedule()
    if items:
        committed = store.commit(store.plan_step([it.entry() for it in items]))
        s.complete(items, [TOKEN] * sum(it.needs_logits for it in items), EOS, committed)
    return items


def run(s: Scheduler, store: FakeStore, limit: int = 200) -> list[Request]:
    """Steps until nothing is left; the requests in the order they finished."""
    done: list[Request] = []
    for _ in range(limit):
        if not s.has_work():
            return done
        step(s, store)
        done += s.drain_finished()
    raise AssertionError(f"not done after {limit} steps: waiting {list(s.waiting)}, running {s.running}")


def scheduler(store: FakeStore, **config) -> Scheduler:
    return Scheduler(store, SchedulerConfig(**{"max_batch_tokens": 16, **config}), max_positions=10_000)


def test_a_turn_runs_to_its_length_and_leaves_its_session_idle():
    store = FakeStore(16, BS)
    s = scheduler(store)
    r = request("a", list(range(10, 20)), new=3)
    s.add(r)
    assert run(s, store) == [r]
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "length" and r.output_ids == [TOKEN] * 3
    assert store.token_ids("a") == list(range(10, 20)) + [TOKEN] * 2    # the last token is not fed back
    assert not store.is_busy("a") and not r.leased


def test_short_turns_are_admitted_before_long_prefills_and_one_sessions_turns_in_order():
    store = FakeStore(64, BS)
    s = scheduler(store, max_batch_tokens=16, short_prefill_tokens=4)
    long_ = request("long", list(range(100, 140)), arrival=1.0)
    short = request("short", [1, 2, 3], arrival=2.0)
    first, second = request("a", [5, 6, 7], arrival=3.0), request("a", [5, 6, 7, TOKEN, 8], arrival=3.5)
    for r in (second, long_, first, short):
        s.add(r)
    items = s.schedule()
    # short turns first, by arrival; then the long prefill with the rest of the budget; `second` waits for
    # `first`, its session's earlier turn, though it is short too
    assert [it.request for it in items] == [short, first, long_]
    assert [len(it.new_ids) for it in items] == [3, 3, 10]
    store.commit(store.plan_step([it.entry() for it in items]))


def test_fcfs_when_nothing_is_short():
    store = FakeStore(64, BS)
    s = scheduler(store, max_batch_tokens=64, short_prefill_tokens=0)
    rs = [request(f"s{i}", list(range(10 * i + 1, 10 * i + 9)), arrival=float(i)) for i in range(3)]
    for r in reversed(rs):
        s.add(r)
    assert [it.request for it in s.schedule()] == rs


def test_a_request_that_cannot_grow_is_suspended_and_resumed_exactly():
    """Two sessions grow past the pool together: the later one is suspended (its KV dropped), then resumed with
    its history recomputed, and both end with every token."""
    store = FakeStore(6, BS)
    s = scheduler(store, max_batch_tokens=32, reserve_fraction=0.0)
    a, b = request("a", list(range(1, 9)), new=6), request("b", list(range(20, 28)), new=6)
    s.add(a)
    s.add(b)
    done = run(s, store)
    assert set(done) == {a, b} and all(r.finish_reason == "length" and len(r.output_ids) == 6 for r in done)
    assert a.suspensions + b.suspensions >= 1 and b.suspensions >= a.suspensions   # the later one gives way
    assert max(a.recomputed, b.recomputed) > 0                                       # resumed by recomputing
    assert store.token_ids("a") == list(range(1, 9)) + [TOKEN] * 5
    assert store.token_ids("b") == list(range(20, 28)) + [TOKEN] * 5


def test_a_request_that_can_never_fit_fails_alone():
    store = FakeStore(4, BS)
    s = scheduler(store, max_batch_tokens=64, reserve_fraction=0.0)
    big, small = request("big", list(range(1, 30))), request("small", [1, 2, 3])
    s.add(big)
    s.add(small)
    done = run(s, store)
    assert big.status is RequestStatus.FAILED and "device blocks" in str(big.error)
    assert small.status is RequestStatus.FINISHED and small in done and not store.is_busy("big")


def test_a_running_warm_up_yields_to_a_queued_turn():
    store = FakeStore(16, BS)
    s = scheduler(store, max_batch_tokens=4)
    s.add(request("w", list(range(1, 13)), new=1))
    run(s, store)
    store.evict("w")                                # its KV dropped: a warm-up recomputes it, 4 rows a step
    warm = request("w", store.token_ids("w"), new=1, warmup=True)
    s.add(warm)
    step(s, store)                                  # the warm-up is running: its first chunk is up
    assert warm.status is RequestStatus.RUNNING
    turn = request("t", [1, 2, 3])
    s.add(turn)
    step(s, store)
    assert warm.status is RequestStatus.CANCELLED and warm.finish_reason == "yielded"
    assert not store.is_busy("w")                   # its lease went back with it
    assert turn in run(s, store)


def test_the_reserve_holds_back_admission_but_not_a_lone_request():
    store = FakeStore(10, BS)
    s = scheduler(store, max_batch_tokens=64, reserve_fraction=0.5)
    a, b = request("a", list(range(1, 17))), request("b", list(range(30, 46)))   # 4 blocks each (+1 to grow)
    s.add(a)
    s.add(b)
    items = s.schedule()
    assert [it.request for it in items] == [a]      # b would leave less than the reserve (5 blocks)
    store.commit(store.plan_step([it.entry() for it in items]))


def test_slo_deferral_keeps_a_prefill_out_while_decodes_have_no_slack():
    store = FakeStore(64, BS)
    slo = SloPolicy(None, tpot_slo=1e-9)            # every running decode is already past its TPOT SLO
    s = Scheduler(store, SchedulerConfig(max_batch_tokens=64), max_positions=10_000, slo=slo)
    a = request("a", [1, 2, 3], new=8)
    s.add(a)
    step(s, store)
    assert a.output_ids                             # decoding now
    b = request("b", list(range(10, 30)))
    s.add(b)
    items = s.schedule()
    assert [it.request for it in items] == [a] and slo.deferred >= 1 and b.status is RequestStatus.WAITING


def test_a_cancelled_request_releases_its_lease():
    store = FakeStore(16, BS)
    s = scheduler(store)
    r = request("a", list(range(1, 9)), new=50)
    s.add(r)
    step(s, store)
    assert store.is_busy("a")
    r.cancel_requested = True
    s.cancel([r])
    s.schedule()
    assert r.status is RequestStatus.CANCELLED and not store.is_busy("a") and not s.has_work()
