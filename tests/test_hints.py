"""Hints: a session's host/disk chunks move up to the device ahead of its request, in the background;
cancelable, harmless if no request follows, and never in the way of a request that arrives mid-hint."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import FAMILIES, Conversation
from test_engine import expected, make_engine  # noqa: F401 (fixture)

from stateful_hf import SamplingParams
from stateful_hf.engine.hints import Hint


def _turn(engine, sid: str, conv: Conversation, n: int = 6) -> list[int]:
    ids = conv.ids[0].tolist()
    out = engine.submit(sid, ids, SamplingParams(max_new_tokens=n)).result(timeout=60)
    conv.reply(torch.tensor([ids + list(out.token_ids)]))
    return list(out.token_ids)


def _park(engine, sid: str, tier: str) -> int:
    n = len(engine.store.session(sid).chunks)
    engine.store.move(sid, range(n), tier)
    return n


@pytest.mark.parametrize("tier", ["host", "disk", "hidden"])
def test_hint_prefetches_then_the_turn_is_exact(tier, make_engine, tmp_path):  # noqa: F811
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    from stateful_hf import SessionStore
    store = SessionStore(model, 1024, chunk_size=16, host_capacity=1024, disk_dir=tmp_path / "kv", disk_capacity=1024,
                         policy="lru", hidden_states="always" if tier == "hidden" else "never")
    engine = make_engine(model, store=store)
    conv = Conversation(seed=7, first=50)
    _turn(engine, "a", conv)
    n = _park(engine, "a", tier)
    assert store.residency("a")["device"] == 0 and store.residency("a")[tier] == store.session("a").num_tokens
    h = engine.hint("a", expected_arrival=2.0)
    assert h.wait(30) and h.stopped == "done", h
    assert h.moved_chunks == n and h.moved_tokens == store.session("a").num_tokens
    assert store.residency("a")["device"] == store.session("a").num_tokens
    before = store.stats().counters
    ids = conv.ids[0].tolist()
    out = engine.submit("a", ids, SamplingParams(max_new_tokens=8)).result(timeout=60)
    assert list(out.token_ids) == expected(oracle, ids, 8)
    after = store.stats().counters
    assert after.swapped_in_host == before.swapped_in_host and after.swapped_in_disk == before.swapped_in_disk
    assert after.restored_hidden == before.restored_hidden
    assert store.stats("a").last_turn.recomputed_tokens == 0
    store.close()


def test_hint_edge_cases(make_engine):  # noqa: F811
    model = FAMILIES["llama"]()
    from stateful_hf import SessionStore
    store = SessionStore(model, 256, chunk_size=16, host_capacity=1024, policy="lru")
    engine = make_engine(model, store=store)
    assert engine.hint("nobody").wait(10) and engine.hints.join(10) is None
    assert engine.hint("nobody").wait(10)
    conv = Conversation(seed=8, first=40)
    _turn(engine, "a", conv)
    # Already on the device: nothing to do.
    h = engine.hint("a")
    assert h.wait(10) and h.stopped == "done" and h.moved_chunks == 0
    # A busy session (its turn is running): the hint steps aside.
    _park(engine, "a", "host")
    with store.lease("a"):
        h = engine.hint("a")
        assert h.wait(10) and h.stopped == "busy" and h.moved_chunks == 0
    # Cancelled before it ran: nothing moves.
    c = Hint("a", None, 0)
    c.cancel()
    assert engine.hints._prefetch(c) == "cancelled" and store.residency("a")["device"] == 0
    # Dropped chunks stay dropped (the turn recomputes them); the rest comes up.
    store.move("a", [0], "dropped")
    h = engine.hint("a")
    assert h.wait(10) and h.stopped == "done"
    r = store.residency("a")
    assert r["dropped"] == 16 and r["device"] == store.session("a").num_tokens - 16
    with pytest.raises(ValueError):
        engine.hint("")
    with pytest.raises(ValueError):
        engine.hint("a", expected_arrival=-1)


def test_hint_never_pushes_other_sessions_down(make_engine):  # noqa: F811
    model = FAMILIES["llama"]()
    from stateful_hf import SessionStore
    # 16 device blocks of 16 tokens; reserve 10% -> 2 blocks.
    store = SessionStore(model, 256, chunk_size=16, host_capacity=2048, policy="lru", swap_out_threshold=0.0)
    engine = make_engine(model, store=store)
    conv_a = Conversation(seed=9, first=100)
    _turn(engine, "a", conv_a)          # 106 tokens: 7 blocks
    n_a = _park(engine, "a", "host")
    for sid, seed in (("b", 10), ("c", 11)):
        _turn(engine, sid, Conversation(seed=seed, first=60))     # 66 tokens: 5 blocks each
    others = {s: store.residency(s) for s in ("b", "c")}
    free = store.free_blocks()                              # 16 - 10 = 6 free, 2 reserved
    h = engine.hint("a")
    assert h.wait(10) and h.stopped == "no room"
    assert h.moved_chunks == free - 2 < n_a
    assert {s: store.residency(s) for s in ("b", "c")} == others


def test_requests_racing_hints_stay_exact(make_engine):  # noqa: F811
    """Hints and turns of 6 sessions from 6 threads, on a device too small for all of them, with host
    and drop pressure: every reply equals stateless generate, and the store stays consistent."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    from stateful_hf import SessionStore
    store = SessionStore(model, 384, chunk_size=16, host_capacity=512, policy="pensieve")
    engine = make_engine(model, store=store, max_batch_tokens=128).start()
    record, errors = [], []

    def user(i: int) -> None:
        sid, conv = f"u{i}", Conversation(seed=200 + i, first=30 + 3 * i)
        try:
            for turn in range(4):
                if turn:
                    engine.hint(sid, expected_arrival=0.01 * i, priority=i % 3)
                    if i % 2:
                        engine.hint(sid).cancel()
                ids = conv.ids[0].tolist()
                out = engine.submit(sid, ids, SamplingParams(max_new_tokens=5)).result(timeout=120)
                record.append((ids, list(out.token_ids)))
                conv.reply(torch.tensor([ids + list(out.token_ids)]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    engine.hints.join(30)
    assert not errors, errors
    assert len(record) == 24
    for ids, got in record:
        assert got == expected(oracle, ids, 5)
