"""The cost profile corrected online from the engine's steps (stateful_hf/profile/correction.py): a profile
taken on a busy host (here: the built-in shape read as seconds, ~1000x a tiny model's chunk) is scaled to
what the steps measure once enough prefill steps agree, and `stats()` says so; decode-heavy steps and steps
within the tolerance change nothing (the controls); the tokens stay the stateless oracle's. Swap-in costs are
measured from the store's moves up to the device whose copies had landed when timed (a synchronous copy, or
a move that waits for it), with the same rules; short moves, moves down and copies only issued (a step's
swap-in under the async emulator) are no evidence (the controls)."""

from __future__ import annotations

import pytest
from conftest import Conversation, engine_round

from stateful_hf import Engine, SessionStore
from stateful_hf.cache import CostProfile
from stateful_hf.cache.movement.moves import MoveBatch
from stateful_hf.profile.correction import CostCorrection, StepRows, step_rows
from stateful_hf.testing import tiny_llama

BUSY = CostProfile(source="measured on a busy host")       # 1.0 s a chunk at 32 tokens, 7.13 s at 8192


def prefill(n: int = 64, start: int = 0) -> StepRows:
    return step_rows([((), start, n, False)])


def test_prefill_steps_scale_the_profile_once_they_agree():
    c = CostCorrection(BUSY, 32)
    truth = 0.01                                   # the host is 100x faster than the profile says
    for i in range(c.min_steps - 1):
        assert c.observe(prefill(64, 32 * i), truth * c.predicted(prefill(64, 32 * i))) is None
    fixed = c.observe(prefill(64, 500), truth * c.predicted(prefill(64, 500)))
    assert fixed is not None and fixed.seconds == pytest.approx(tuple(s * truth for s in BUSY.seconds))
    assert fixed.lengths == BUSY.lengths and "corrected online x0.01" in fixed.source
    assert c.observe(prefill(64), 1.2 * truth * c.predicted(prefill(64))) is None   # within tolerance: kept


def test_decode_heavy_and_short_steps_are_not_evidence():
    c = CostCorrection(BUSY, 32)
    decode = step_rows([((), 100 + i, 1, True) for i in range(40)] + [((), 0, 40, False)])
    short = prefill(16)
    for _ in range(3 * c.min_steps):
        assert c.observe(decode, 1e-6) is None and c.observe(short, 1e-6) is None
    assert c.observed == 0 and c.scale == 1.0


def test_recomputed_rows_count_at_their_positions():
    rows = step_rows([((0, 1, 2, 3), 600, 2, True), ((), 10, 30, False)])
    assert rows.entries == ((4, 2.5, False), (2, 601.5, True), (30, 25.5, False))
    assert rows.prefill_rows == 34 and rows.decode_rows == 2


def test_the_engine_corrects_a_busy_hosts_profile():
    model, oracle = tiny_llama(), tiny_llama()
    store = SessionStore(model, 4096, cost_profile=BUSY)
    engine = Engine(model, store=store, max_batch_tokens=64)
    try:
        assert store.stats().cost_profile == BUSY.source
        convs = {f"s{i}": Conversation(seed=700 + i, first=70) for i in range(10)}
        for sid, conv in convs.items():                    # one prefill-led turn at a time
            engine_round(engine, {sid: conv}, oracle, n=2)
        used = store.policy.profile
        assert "corrected online" in store.stats().cost_profile, store.stats().cost_profile
        # a tiny model's 64-row step takes milliseconds (~0.2 s on a host at load 10), not the 2 s BUSY predicts
        assert used.seconds[0] < BUSY.seconds[0] / 2 and engine.cost.observed >= engine.cost.min_steps
    finally:
        engine.stop()
    store.check_integrity()


def moved(src: str, dst: str, chunks: int, seconds: float, landed: bool = True) -> MoveBatch:
    return MoveBatch(src, dst, "step", chunks, chunks * 32, 0, seconds, (("s", chunks * 32),), landed)


def test_swap_ins_that_landed_measure_the_swap_in_cost():
    c = CostCorrection(BUSY, 32)
    for _ in range(3 * c.min_steps):           # the controls: no evidence
        for batch in (moved("host", "device", 3, 1.0), moved("host", "device", 8, 1.0, landed=False),
                      moved("device", "host", 8, 1.0), moved("hidden", "device", 8, 1.0)):
            c.observe_move(batch)
    assert not any(c.swap_samples.values()) and c.profile is BUSY and c.observe(prefill(16), 1.0) is None
    for i in range(c.min_steps):
        c.observe_move(moved("host", "device", 4, 4e-3 * (1 + i % 2)))       # 1 ms and 2 ms a chunk
        c.observe_move(moved("disk", "device", 8, 8e-2))
    fixed = c.observe(prefill(16), 1.0)                                    # the next step hands it over
    assert fixed is not None and dict(fixed.swap_in) == pytest.approx({"host": 1.5e-3, "disk": 1e-2})
    assert fixed.seconds == BUSY.seconds and "swap-in from host 0.0015 s a chunk" in fixed.source
    assert c.observe(prefill(16), 1.0) is None                             # said once
    for _ in range(c.window):                                              # within x1.5: kept
        c.observe_move(moved("host", "device", 4, 4 * 2e-3))
    assert c.observe(prefill(16), 1.0) is None and c.swap_in["host"] == 1.5e-3
    for _ in range(c.window):                      # past it: corrected once the median strays past x1.5
        c.observe_move(moved("host", "device", 4, 4 * 5e-3))
    assert dict(c.observe(prefill(16), 1.0).swap_in)["host"] == pytest.approx((2e-3 + 5e-3) / 2)


@pytest.mark.parametrize("emulate", [False, True])
def test_the_engine_measures_swap_ins_from_the_stores_moves(emulate):
    """On the CPU a step's swap-in copy is synchronous: timed, it is evidence. Under the async emulator a step's
    swap-in is only issued when recorded (the step's layers wait on it): no evidence, until moves up that wait
    for their copies (`store.move`, a hint's prefetch) are made."""
    model, oracle = tiny_llama(), tiny_llama()
    store = SessionStore(model, 4096, host_capacity=4096, chunk_size=8, cost_profile=BUSY, swap_out_threshold=0,
                         emulate_async=emulate)
    engine = Engine(model, store=store)
    try:
        conv = {"s": Conversation(seed=720, first=40)}
        engine_round(engine, conv, oracle, n=2)
        for _ in range(engine.cost.min_steps):
            store.move("s", range(len(store.session("s").chunks)), "host")     # >= 5 chunks each time
            engine_round(engine, conv, oracle, n=2)
        samples = engine.cost.swap_samples["host"]
        assert len(samples) == (0 if emulate else engine.cost.min_steps)
        for _ in range(engine.cost.min_steps if emulate else 0):
            every = range(len(store.session("s").chunks))
            store.move("s", every, "host")
            store.move("s", every, "device")                                  # waits for its copies
        engine_round(engine, conv, oracle, n=2)                                 # a step hands the profile over
        assert "swap-in from host" in store.stats().cost_profile, store.stats().cost_profile
        assert 0 < dict(store.policy.profile.swap_in)["host"] < 1
    finally:
        engine.stop()
    store.check_integrity()


def test_a_stopped_engine_stops_listening_to_the_stores_moves():
    """The correction hears the store's moves while its engine runs: stopped, it is unsubscribed (engines made
    one after another on one store leave no listener behind), started again, it listens again."""
    model = tiny_llama()
    store = SessionStore(model, 4096, host_capacity=4096, chunk_size=8, cost_profile=BUSY)
    before = len(store.moves.listeners)
    for _ in range(3):
        engine = Engine(model, store=store).start()
        assert engine.cost.observe_move in store.moves.listeners
        engine.stop()
        assert len(store.moves.listeners) == before
    engine.start()
    assert store.moves.listeners.count(engine.cost.observe_move) == 1
    engine.stop()
