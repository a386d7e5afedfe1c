"""Warm-ups (engine/warmup.py): a session's dropped and lower-tier history brought up to the device before its
expected turn, so the turn computes only its new input; exact against stateless generate, never in a turn's way
(lowest priority, yields to its session's turn even under on_busy="refuse"), and once per expectation."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import greedy

from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.testing import tiny_llama

N = 5


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _drain(engine) -> None:
    while engine.has_work():
        engine.step()


def _first_turn(engine, sid: str, seed: int) -> list[int]:
    ids = torch.randint(3, 300, (90,), generator=torch.Generator().manual_seed(seed)).tolist()
    h = engine.submit(sid, ids, SamplingParams(max_new_tokens=N))
    _drain(engine)
    return ids + list(h.result().token_ids)


def _park(store, sid: str) -> None:
    """Half of the session's chunks to the host, the rest dropped (token ids only)."""
    n = len(store.places(sid))
    store.move(sid, range(n // 2), "host")
    store.move(sid, range(n // 2, n), "dropped")


def _returning_turn(engine, oracle, sid: str, history: list[int]):
    ids = history + [7, 8, 9, 10]
    h = engine.submit(sid, ids, SamplingParams(max_new_tokens=N))
    _drain(engine)
    out = h.result()
    want = greedy(oracle, torch.tensor([ids]), n=N)[0, len(ids):].tolist()
    assert list(out.token_ids) == want, sid
    return out.metrics


def test_a_warm_up_brings_the_history_up_and_the_next_turn_is_exact():
    model, oracle = tiny_llama(), tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, host_capacity=1024, max_batch_tokens=48)
    store = engine.store
    histories = {sid: _first_turn(engine, sid, seed) for seed, sid in enumerate(("warm", "cold"))}
    for sid in histories:
        _park(store, sid)
    ids_before = store.token_ids("warm")
    h = engine.warm("warm")
    _drain(engine)
    out = h.result()
    assert out.finish_reason == "warmup" and out.token_ids == () and out.metrics.recomputed_tokens > 0
    assert store.token_ids("warm") == ids_before                              # adds nothing to the session
    assert all(p.value == "device" for p in store.places("warm")) and not store.missing_positions("warm")
    store.check_integrity()
    assert engine.warm("warm") is None                                         # all up already
    assert engine.warm("nobody") is None
    warm = _returning_turn(engine, oracle, "warm", histories["warm"])
    cold = _returning_turn(engine, oracle, "cold", histories["cold"])         # negative control: no warm-up
    assert warm.recomputed_tokens == 0 and warm.swapped_tokens == 0 and warm.reused_tokens == len(ids_before)
    assert cold.recomputed_tokens > 0 and cold.swapped_tokens > 0
    store.check_integrity()


def test_the_engine_warms_a_session_ahead_of_its_expected_turn_once():
    model, oracle = tiny_llama(), tiny_llama()
    clock = Clock()
    store = SessionStore(model, 1024, chunk_size=16, host_capacity=1024, clock=clock)
    engine = Engine(model, store=store, max_batch_tokens=64, warm_ahead=1.0)
    history = _first_turn(engine, "a", 0)
    engine.hint("a", expected_arrival=5.0).wait(10)        # the hint's own prefetch moves what it can now
    _park(store, "a")
    clock.t = 3.5                                          # not yet: 5 - 1 = 4
    engine.step()
    assert not engine.has_work() and store.missing_positions("a")
    clock.t = 4.0
    assert engine.has_work()
    _drain(engine)
    assert all(p.value == "device" for p in store.places("a")) and not store.missing_positions("a")
    _park(store, "a")
    clock.t = 4.5
    engine.step()                                          # the expectation was served: no second warm-up
    assert not engine.has_work() and store.missing_positions("a")
    assert _returning_turn(engine, oracle, "a", history).recomputed_tokens > 0
    store.check_integrity()


def test_the_background_loop_wakes_for_a_warm_up():
    model = tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, host_capacity=1024, warm_ahead=1.0)
    _first_turn(engine, "a", 0)
    _park(engine.store, "a")
    with engine:
        engine.hint("a", expected_arrival=1.3)             # due in 0.3 s, while the loop is idle
        deadline = time.monotonic() + 20
        while engine.store.missing_positions("a") or engine.store.is_busy("a"):
            assert time.monotonic() < deadline, "the idle loop never ran the warm-up"
            time.sleep(0.05)
    assert all(p.value == "device" for p in engine.store.places("a"))
    engine.store.check_integrity()


def test_a_hint_far_in_the_future_is_clamped_and_the_loop_keeps_serving():
    """expected_arrival=1e300 (finite, a fuzzer's value) once overflowed the idle loop's wait and stopped the
    engine's thread; the store clamps it to max_retain and the engine waits for what the store recorded."""
    model = tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, warm_ahead=1.0)
    ids = _first_turn(engine, "a", 0)
    with engine:
        engine.hint("a", expected_arrival=1e300)
        time.sleep(0.2)                                    # the idle loop waits, at most until the clamped time
        assert engine.warmups.next_at <= engine.store.clock() + engine.store.config.max_retain + 1
        out = engine.submit("b", ids[:40], SamplingParams(max_new_tokens=N)).result(timeout=60)
    assert list(out.token_ids) == greedy(model, torch.tensor([ids[:40]]), N)[0, 40:].tolist()


@pytest.mark.parametrize("steps_before", [0, 1])
def test_a_turn_of_the_session_ends_its_warm_up_and_is_exact_even_under_refuse(steps_before):
    model, oracle = tiny_llama(), tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, host_capacity=1024, max_batch_tokens=32,
                    on_busy="refuse")
    store = engine.store
    history = _first_turn(engine, "a", 1)
    _park(store, "a")
    w = engine.warm("a")
    for _ in range(steps_before):                          # 1: the warm-up is running, part of it recomputed
        engine.step()
    assert store.missing_positions("a")
    _returning_turn(engine, oracle, "a", history)          # not refused; exact
    assert w.result().finish_reason in ("cancelled", "superseded", "yielded")
    store.check_integrity()


def test_a_warm_up_comes_after_every_queued_turn():
    model = tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, host_capacity=1024, max_batch_tokens=64)
    _first_turn(engine, "a", 2)
    _park(engine.store, "a")
    w = engine.warm("a")
    ids = torch.randint(3, 300, (64,), generator=torch.Generator().manual_seed(3)).tolist()   # the whole budget
    turn = engine.submit("b", ids, SamplingParams(max_new_tokens=2))
    rec = engine.step()
    assert [e[0] for e in rec.entries] == ["b"]            # the turn took the budget; the warm-up waits
    _drain(engine)
    assert turn.result().finish_reason == "length" and w.result().finish_reason == "warmup"
    engine.store.check_integrity()


def test_warm_ahead_option():
    with pytest.raises(ValueError, match="warm_ahead"):
        Engine(tiny_llama(), device_capacity=256, warm_ahead=0)
    clock = Clock()
    store = SessionStore(tiny_llama(), 1024, chunk_size=16, host_capacity=1024, clock=clock)
    engine = Engine(store.model, store=store, warm_ahead=None)     # off: expectations only rank
    _first_turn(engine, "a", 0)
    engine.hint("a", expected_arrival=2.0).wait(10)
    _park(store, "a")
    clock.t = 1.9
    assert not engine.has_work()
    engine.step()
    assert store.missing_positions("a")


def test_a_queued_turn_survives_a_release_that_drops_its_history_in_the_same_pass():
    """Found by the agent benchmark's warm-ups: a turn asks the store what it needs when it is queued; in the
    same pass a release (here a cancelled turn's, whose ahead-of-time swap-out can drop idle host chunks:
    injected) dropped that history. Admission asks again after such a change, so the turn recomputes it and
    is exact, instead of failing with "chunk N is dropped"."""
    model, oracle = tiny_llama(), tiny_llama()
    engine = Engine(model, device_capacity=1024, chunk_size=16, host_capacity=1024, max_batch_tokens=64)
    store = engine.store
    history = _first_turn(engine, "a", 4)
    store.move("a", range(len(store.places("a"))), "host")
    other = engine.submit("b", list(range(3, 40)), SamplingParams(max_new_tokens=30))
    engine.step()                                          # b holds its lease
    end = store.end

    def end_dropping_a(session_id, generated):
        room = end(session_id, generated)
        if session_id == "b":
            store.move("a", range(len(store.places("a"))), "dropped")
        return room

    store.end = end_dropping_a
    other.cancel()                                         # reaped at the next pass, after a's turn is queued
    ids = history + [7, 8, 9, 10]
    h = engine.submit("a", ids, SamplingParams(max_new_tokens=N))
    _drain(engine)
    out = h.result()
    assert out.error is None and other.result().finish_reason == "cancelled"
    assert list(out.token_ids) == greedy(oracle, torch.tensor([ids]), n=N)[0, len(ids):].tolist()
    assert out.metrics.recomputed_tokens > 0               # the dropped history was recomputed, not read
    store.check_integrity()
