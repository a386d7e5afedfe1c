"""SLO-aware admission (LayerKV §3.1) and SLO metrics: exact outputs with SLOs set, the prefill-time
profile fit, the slack gate driven with controlled numbers, bad configuration, violation stats."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round, greedy

from stateful_hf import Engine, SamplingParams
from stateful_hf.engine.request import Request, RequestStatus
from stateful_hf.engine.scheduler import Scheduler, SchedulerConfig
from stateful_hf.engine.slo import OutputLengths, PrefillProfile, SloPolicy, check_slo


@pytest.mark.parametrize("name", ["ttft_slo", "tpot_slo"])
@pytest.mark.parametrize("value", [0, -0.5, "1s", math.nan, math.inf, True, [1.0]])
def test_bad_configuration_raises(name, value):
    with pytest.raises(ValueError, match=name):
        Engine(FAMILIES["llama"](), device_capacity=256, chunk_size=16, **{name: value})


def test_check_slo_accepts_positive_numbers():
    assert check_slo("ttft_slo", None) is None
    assert check_slo("ttft_slo", 2) == 2.0 and check_slo("tpot_slo", np.float32(0.25)) == 0.25


def test_prefill_profile_fits_known_quadratic():
    a, b, c = 2e-3, 1e-4, 3e-7
    prof = PrefillProfile(prior_seconds_per_token=5e-3)
    assert prof.predict(100) == pytest.approx(0.5)            # prior before any point
    prof.observe(10, a + b * 10 + c * 100)
    assert prof.coefficients() is None                         # one distinct n: its rate, no fit
    assert prof.predict(20) == pytest.approx(2 * (a + b * 10 + c * 100))
    for n in range(16, 520, 16):
        prof.observe(n, a + b * n + c * n * n)
    assert prof.coefficients() == pytest.approx([a, b, c], rel=1e-6, abs=1e-9)
    assert prof.predict(2048) == pytest.approx(a + b * 2048 + c * 2048 ** 2, rel=1e-6)
    assert prof.predict(0) == 0.0


def test_output_lengths_percentile_per_session_then_global():
    lengths = OutputLengths(percentile=90)
    assert lengths.predict_total("s", cap=64) == 64            # nothing observed: the request's cap
    for n in range(1, 11):                                     # global 1..10: p90 ("higher") = 10
        lengths.observe("other", n)
    assert lengths.predict_total("s", cap=64) == 10
    lengths.observe("s", 3)
    assert lengths.predict_total("s", cap=64) == 3             # the session's own history wins
    assert lengths.predict_total("other", cap=5) == 5          # never past max_new_tokens


def _request(rid: int, sid: str, n: int, max_new: int = 100) -> Request:
    return Request(rid, sid, list(range(3, 3 + n)), SamplingParams(max_new_tokens=max_new), None)


def test_slack_gate_defers_then_admits_fcfs(make_store):
    """A decodes; B and C (20 prompt rows each, predicted 2 s each) queue. Slack of A with
    T_tpot = 0.05, n_f = 100 - n_h (cap, nothing observed), step 0.01 s, clock 100 + t:
    Δt = 0.05·100 − (t + n_f·0.01). Small slack: nothing admitted; slack for one: B only (FCFS)."""
    store = make_store(FAMILIES["llama"](), 1024, chunk_size=16)
    now = [0.0]
    slo = SloPolicy(None, 0.05, prior_seconds_per_token=0.1, clock=lambda: now[0])
    sched = Scheduler(store, SchedulerConfig(max_batch_tokens=256), store.adapter.max_positions, slo)
    a, b, c = _request(0, "a", 10), _request(1, "b", 20), _request(2, "c", 20)
    sched.add(a)
    items = sched.schedule()                                   # nothing decodes: admitted although 1 s
    assert [it.request for it in items] == [a]
    sched.complete(items, [5], frozenset())
    a.first_token_at, slo.decode_step = 100.0, 0.01          # t = now − 100 (0.0 would read as unset)
    sched.add(b)
    sched.add(c)

    now[0] = 103.0                      # n_h = 1, n_f = 99: Δt = 5 − 3 − 0.99 = 1.01 < 2
    assert slo.allowance(sched.running) == pytest.approx(1.01)
    items = sched.schedule()
    assert [it.request for it in items] == [a] and sched.waiting == [b, c] and slo.deferred == 1
    sched.complete(items, [6], frozenset())

    now[0] = 101.0                      # n_h = 2, n_f = 98: Δt = 5 − 1 − 0.98 = 3.02: B fits, B + C do not
    items = sched.schedule()
    assert [it.request for it in items] == [a, b] and sched.waiting == [c] and slo.deferred == 2
    sched.complete(items, [7, 8], frozenset())

    now[0] = 90.0                       # ample slack: C joins
    assert [it.request for it in sched.schedule()] == [a, b, c]
    for r in (a, b, c):
        sched.finish(r, RequestStatus.CANCELLED, "cancelled")


def test_without_tpot_slo_nothing_is_deferred(make_store):
    store = make_store(FAMILIES["llama"](), 1024, chunk_size=16)
    slo = SloPolicy(0.001, None, prior_seconds_per_token=100.0, clock=lambda: 1e9)
    sched = Scheduler(store, SchedulerConfig(max_batch_tokens=256), store.adapter.max_positions, slo)
    a, b = _request(0, "a", 10), _request(1, "b", 20)
    sched.add(a)
    items = sched.schedule()
    sched.complete(items, [5], frozenset())
    a.first_token_at = 100.0
    sched.add(b)
    assert [it.request for it in sched.schedule()] == [a, b] and slo.deferred == 0
    for r in (a, b):
        sched.finish(r, RequestStatus.CANCELLED, "cancelled")


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_exact_with_tight_slos_and_violation_stats(family):
    """A TPOT SLO no CPU step meets: every admission while something decodes is deferred, yet the
    engine drains (nothing decoding → admit) and every reply equals stateless greedy generate."""
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    engine = Engine(model, device_capacity=1024, chunk_size=16, max_batch_tokens=32,
                    ttft_slo=100.0, tpot_slo=1e-6)
    convs = {f"{family}-{i}": Conversation(seed=40 + i, first=18 + i) for i in range(4)}
    for _ in range(2):
        engine_round(engine, convs, oracle, n=5)
    st = engine.stats()
    assert st.finished_requests == 8 and st.slo_deferrals > 0
    assert (st.tpot_measured, st.tpot_slo_violations, st.tpot_slo_violation_rate) == (8, 8, 1.0)
    assert (st.ttft_measured, st.ttft_slo_violations, st.ttft_slo_violation_rate) == (8, 0, 0.0)
    # the engine learned: prefill points, a decode step time, output lengths per session
    assert len(engine.slo.prefill.points) > 0 and engine.slo.decode_step is not None
    assert len(engine.slo.outputs.all) == 8 and engine.slo.outputs.predict_total(f"{family}-0", 64) == 5
    # per-request metrics of one more turn
    sid = f"{family}-0"
    ids = convs[sid].ids
    out = engine.generate([sid], [ids[0].tolist()], SamplingParams(max_new_tokens=4))[0]
    assert list(out.token_ids) == greedy(oracle, ids, n=4)[0, ids.shape[1]:].tolist()
    m = out.metrics
    assert m.queue_time is not None and 0 <= m.queue_time <= m.ttft and m.tpot > 0
    assert m.ttft_slo_violated is False and m.tpot_slo_violated is True
    engine.store.check_integrity()


def test_no_slo_is_todays_behaviour():
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, device_capacity=1024, chunk_size=16, max_batch_tokens=32)
    assert engine.slo is None and engine.scheduler.slo is None
    x = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    out = engine.generate(["s"], [x[0].tolist()], SamplingParams(max_new_tokens=4))[0]
    assert list(out.token_ids) == greedy(oracle, x, n=4)[0, 20:].tolist()
    assert out.metrics.ttft_slo_violated is None and out.metrics.tpot_slo_violated is None
    st = engine.stats()
    assert (st.ttft_measured, st.tpot_measured, st.slo_deferrals) == (0, 0, 0)
