"""The scheduler's rules without a model: it is driven over the fake store (tests/fake_store.py, held to the real
store's contract by tests/test_store_contract.py), each step planned and committed through the door as the runner
does, the sampled token a fixed one. Admission order, suspension and resumption, warm-ups yielding, SLO deferral,
the reserve and the lease; admission's verdicts, which the scheduler alone applies; LayerKV's decisions as the
scheduler takes them from its layer-wise part (`LayerScheduling`), here a scripted one. (LayerKV's own decisions
need a host tier, which the fake has not: tests/test_layerwise.py.)"""

from __future__ import annotations

import dataclasses
import itertools

from fake_store import FakeStore

from stateful_hf.cache.doors.engine import CapacityError, TurnStats
from stateful_hf.engine.layer_offload import AllLayers, LayerFit, PushDown
from stateful_hf.engine.request import Request, RequestStatus, WorkItem
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


# ---- admission's verdicts: admission decides, the scheduler applies ----------------------------------------------

def state(r: Request) -> tuple:
    """Every field of `r`, its lists copied: equal before and after iff nothing changed it."""
    return tuple(list(v) if isinstance(v, list) else v for v in (getattr(r, f.name) for f in dataclasses.fields(r)))


class Verdicts:
    """Wraps a scheduler's `admission.admit`: records each call as (request, verdict, its state before, its state
    right after `admit` returned, before the scheduler applied the verdict)."""

    def __init__(self, s: Scheduler):
        self.admit, self.calls = s.admission.admit, []
        s.admission.admit = self

    def __call__(self, r, *args, **kwargs):
        before = state(r)
        verdict = self.admit(r, *args, **kwargs)
        self.calls.append((r, verdict, before, state(r)))
        return verdict


def test_an_admitted_turn_takes_its_state_from_the_verdict_the_scheduler_applies():
    """A returning session with a dropped chunk: admission begins its turn and changes nothing of the request; the
    scheduler sets the rows, lease and counts the verdict carries, holding the store's answer (the same object)."""
    store = FakeStore(16, BS)
    s = scheduler(store)
    s.add(request("a", list(range(10, 20)), new=3))
    run(s, store)
    history = store.token_ids("a")                                   # 12 ids
    store.move("a", [0], "dropped")                                  # positions 0..3 to recompute
    r = request("a", history + [8, 9])
    s.add(r)
    asked = r.needs                                                  # the store's answer, asked at add
    verdicts = Verdicts(s)
    items = s.schedule()
    [(who, v, before, after)] = verdicts.calls
    assert who is r and before == after                             # admission changed nothing of it
    assert state(r) != after                                         # the control: the snapshot sees the apply
    assert v.item is not None and v.answer is None and v.error is None and isinstance(v.turn, TurnStats)
    assert list(v.rows.missing) == [0, 1, 2, 3] and list(v.rows.pending) == [8, 9]
    assert v.item.recompute == (0, 1, 2, 3) and v.item.new_ids == (8, 9)
    assert items == [v.item] and r.needs is asked and r.leased and r.status is RequestStatus.RUNNING
    assert (r.pending, r.missing, r.missing_ids) == ([8, 9], [0, 1, 2, 3], history[:4])
    assert (r.reused, r.truncated) == (v.turn.reused_tokens, v.turn.truncated_tokens) == (8, 0)
    s.complete(items, [TOKEN], EOS, store.commit(store.plan_step([it.entry() for it in items])))
    assert r.recomputed == 4 and r.output_ids == [TOKEN]             # the item the verdict carried ran
    assert run(s, store) == [r] and store.token_ids("a") == history + [8, 9] + [TOKEN] * 2


def test_a_verdict_that_refuses_fails_the_request_and_later_ones_pass():
    """Alone and too big for the pool: the verdict carries the error and changes nothing; the scheduler fails the
    request with that very error, and the next queued one is admitted in the same pass."""
    store = FakeStore(4, BS)
    s = scheduler(store, max_batch_tokens=64, reserve_fraction=0.0, short_prefill_tokens=0)
    big, small = request("big", list(range(1, 30)), arrival=1.0), request("small", [1, 2, 3], arrival=2.0)
    s.add(big)
    s.add(small)
    verdicts = Verdicts(s)
    items = s.schedule()
    (r0, v0, before0, after0), (r1, v1, _, _) = verdicts.calls
    assert r0 is big and before0 == after0 and RequestStatus.WAITING in after0
    assert v0.item is None and v0.skip and isinstance(v0.error, CapacityError) and v0.turn is None
    assert big.status is RequestStatus.FAILED and big.error is v0.error and not store.is_busy("big")
    assert r1 is small and v1.item is not None and [it.request for it in items] == [small]


def test_a_busy_sessions_turn_is_skipped_and_keeps_the_stores_latest_answer():
    """A second turn of a session whose first is running: the verdict skips it (later requests pass), each pass's
    fresh answer recorded as it came; a head of line that does not fit waits instead (strict order, the control)."""
    store = FakeStore(64, BS)
    s = scheduler(store, max_batch_tokens=64)
    first = request("a", [1, 2, 3], new=5, arrival=1.0)
    s.add(first)
    step(s, store)                                                   # `first` runs, holding a's lease
    second, other = request("a", [1, 2, 3, TOKEN, 4], arrival=2.0), request("b", [5, 6, 7], arrival=3.0)
    s.add(second)
    s.add(other)
    verdicts = Verdicts(s)
    items = s.schedule()
    [(r0, v0, before0, after0), (r1, v1, _, _)] = verdicts.calls
    assert r0 is second and v0.skip and v0.item is None and v0.error is None and before0 == after0
    assert second.status is RequestStatus.WAITING and second.needs.busy and not second.pending
    assert r1 is other and v1.item is not None and other in [it.request for it in items]
    store.commit(store.plan_step([it.entry() for it in items]))
    s.room = None
    verdicts.calls.clear()
    s.schedule()                                                     # a new pass: asked again, still busy
    [(r2, v2, _, _)] = [c for c in verdicts.calls if c[0] is second]
    assert v2.answer is not None and v2.skip and second.needs is v2.answer.needs and second.needs.busy
    assert second.needs_pass == v2.answer.pass_ == (s.passes, s.epoch)
    # the control: a head of line that does not fit (the reserve) waits, and nothing after it is admitted
    store2 = FakeStore(10, BS)
    s2 = scheduler(store2, max_batch_tokens=64, reserve_fraction=0.5)
    a, b, c = request("x", list(range(1, 17))), request("y", list(range(30, 46))), request("z", [1, 2])
    for r in (a, b, c):
        s2.add(r)
    verdicts2 = Verdicts(s2)
    assert [it.request for it in s2.schedule()] == [a]
    assert [(r, v.item is None, v.skip) for r, v, _, _ in verdicts2.calls] == [(a, False, False), (b, True, False)]
    assert c.status is RequestStatus.WAITING and c.needs is not None and not c.leased


# ---- LayerKV's decisions, as the scheduler takes them from its layer-wise part ------------------------------------

class ScriptedLayers(AllLayers):
    """A layer-wise part whose decisions a test dictates, recording what it was asked; it changes no store (only
    `schedule()` is checked). `freed`: device blocks each push-down frees; `push_self`: with no later request to
    push, push the asking one itself (its item then keeps no layer on the device); `factor`: the keep factor of
    an admission; `starve`: the requests no host slot is left for."""

    room_hint = ""

    def __init__(self, store: FakeStore, freed: int = 0, push_self: bool = False, factor: int = 1,
                 starve: frozenset[str] = frozenset()):
        super().__init__(store)
        self.freed, self.push_self, self.factor, self.starve = freed, push_self, factor, starve
        self.asked: list[tuple] = []

    def make_room(self, r, item, need, avail, later):
        self.asked.append((r, need, avail, list(later)))
        pushed = []
        for q in reversed(later):
            if need <= avail:
                break
            pushed.append(PushDown(q, self.freed, q.needs, 0))
            avail += self.freed
        if need > avail and self.push_self:
            return dataclasses.replace(item, factor=0), pushed + [PushDown(r, self.freed, r.needs, 0)]
        return item, pushed

    def fit_host(self, r: Request, item: WorkItem, taken: int) -> WorkItem | None:
        return None if r.session_id in self.starve else item

    def layer_factor(self, r, needs, rows, keep, held, room, host_avail) -> LayerFit:
        return LayerFit(self.factor)


def decoding_pair(layers: AllLayers | None = None) -> tuple[Scheduler, FakeStore, Request, Request]:
    """Two sessions of one block each on a 4-block pool, decoding until the pass where both need a third block and
    none is left: the scheduler is at that pass's schedule()."""
    store = FakeStore(4, BS)
    s = Scheduler(store, SchedulerConfig(max_batch_tokens=32, reserve_fraction=0.0), 10_000, layers=layers)
    a, b = request("a", [1, 2, 3, 4], new=8, arrival=1.0), request("b", [5, 6, 7, 8], new=8, arrival=2.0)
    s.add(a)
    s.add(b)
    while a.length < 8:                               # positions 0..7: two chunks each, the pool full
        assert {it.request for it in step(s, store)} == {a, b}
    assert store.free_blocks() == 0 and a.length == b.length == 8
    return s, store, a, b


def test_a_running_request_short_of_blocks_pushes_later_layers_down_before_anyone_is_suspended():
    """Both decodes open a chunk with no block free: the layer-wise part is asked first (for the older one, with
    the later one to push), its push-down is applied to the pushed request, and no one is suspended. The control:
    the default part (every layer on the device) suspends the later one in the same state."""
    s, _, a, b = decoding_pair()
    assert [it.request for it in s.schedule()] == [a] and b.suspensions == 1    # the control
    layers = ScriptedLayers(None, freed=2)              # its store is not read here
    s, _, a, b = decoding_pair(layers)
    items = s.schedule()
    assert [it.request for it in items] == [a, b] and a.suspensions == b.suspensions == 0
    assert layers.asked == [(a, 1, 0, [b])]             # asked once: b's own need fit in what the push freed
    assert (a.factor, b.factor) == (1, 0)               # the push-down's keep factor, applied by the scheduler


def test_a_request_that_pushes_itself_down_runs_its_item_keeping_no_layer():
    """Pushing the later one down frees nothing: the part pushes the asking one down too; the scheduler applies
    both before weighing the cut item again, which then fits (a factor-0 item takes no device block), and the
    later one's next item keeps no layer either. The control: freeing nothing without pushing itself suspends."""
    s, _, a, b = decoding_pair(ScriptedLayers(None, freed=0))
    assert [it.request for it in s.schedule()] == [a] and b.suspensions == 1    # the control
    layers = ScriptedLayers(None, freed=0, push_self=True)
    s, _, a, b = decoding_pair(layers)
    items = s.schedule()
    assert [(it.request, it.factor) for it in items] == [(a, 0), (b, 0)] and a.suspensions == b.suspensions == 0
    assert layers.asked == [(a, 1, 0, [b])] and a.factor == b.factor == 0


def test_a_layered_admission_takes_the_parts_keep_factor_and_host_starvation_fails_the_oldest_alone():
    store = FakeStore(16, BS)
    s = Scheduler(store, SchedulerConfig(max_batch_tokens=32), 10_000, layers=ScriptedLayers(store, factor=2))
    r = request("a", list(range(1, 10)))
    s.add(r)
    [item] = s.schedule()
    assert item.request is r and item.factor == 2 and r.factor == 2          # the verdict's factor, applied
    # a running request the host has no slot for waits; with nothing else to run it fails alone
    store = FakeStore(16, BS)
    s = Scheduler(store, SchedulerConfig(max_batch_tokens=32), 10_000, layers=ScriptedLayers(store, starve={"b"}))
    a, b = request("a", [1, 2, 3], arrival=1.0), request("b", [4, 5, 6], arrival=2.0)
    s.add(a)
    s.add(b)
    step(s, store)
    s.layers.starve = frozenset({"a", "b"})
    assert s.schedule() == [] and a.status is RequestStatus.FAILED and "host slots" in str(a.error)
    assert b.status is RequestStatus.RUNNING                                  # the oldest alone
