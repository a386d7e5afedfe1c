"""The cost profile corrected online from the engine's steps (stateful_hf/profile/correction.py): a profile
taken on a busy host (here: the built-in shape read as seconds, ~1000x a tiny model's chunk) is scaled to
what the steps measure once enough prefill steps agree, and `stats()` says so; decode-heavy steps and steps
within the tolerance change nothing (the controls); the tokens stay the stateless oracle's."""

from __future__ import annotations

import pytest
from conftest import Conversation, engine_round

from stateful_hf import Engine, SessionStore
from stateful_hf.cache import CostProfile
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
