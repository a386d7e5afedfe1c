"""`attn_backend="auto"` on the CPU, per step (kernels/step_backends.py): the rule measured at store creation, the
split step (the C++ kernel for the short runs, torch for the long ones, kernel_plan.SplitPlan) against the float64
reference and each kernel alone, and the engine exact on split steps."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round
from hypothesis import HealthCheck, assume, given, settings
from test_kernels import assert_close_to_reference, ragged_case

from stateful_hf import Engine, SessionStore
from stateful_hf.integration import session_store
from stateful_hf.kernels import KernelState, StepBackends, kernel_plan, paged_attention, step_backends
from stateful_hf.kernels.cpu_backend import available, unavailable_reason
from stateful_hf.testing import tiny_gemma2

pytestmark = pytest.mark.skipif(not available("cpu"), reason=f"CPU kernel not built: {unavailable_reason()}")


def test_the_rule_gives_short_runs_to_one_kernel_long_ones_to_the_other_and_mixed_steps_to_both():
    rule = StepBackends("torch", "cpu", 16)
    assert rule.for_step([1, 1, 16]) == "cpu"
    assert rule.for_step([17, 300]) == "torch"
    assert rule.for_step([1, 40, 1]) == kernel_plan.SPLIT
    assert StepBackends("torch").for_step([1, 400]) == "torch"
    assert "cpu for sub-requests of <= 16 query rows" in rule.describe()
    with pytest.raises(AssertionError):
        StepBackends("torch", "cpu")               # a short backend without its bound
    with pytest.raises(AssertionError):
        StepBackends("cpu", "cpu", 4)
    with pytest.raises(AssertionError):
        StepBackends("cpu", "torch", 4)            # SplitPlan splits the other way round only
    assert rule.for_step([0, 40]) == "torch" and rule.for_step([0, 1]) == "cpu"   # no rows: on neither side


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64, 80), max_len=60))
def test_a_split_step_gives_each_row_the_result_of_its_kernel(case):
    query, kc, vc, batch, window = case
    cu_q = batch.host[0]
    runs = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths = sorted(set(r for r in runs if r))
    assume(len(lengths) >= 2)                          # one kind of run only: no split step
    rows = lengths[0]
    out = paged_attention(query, kc, vc, batch, backend=kernel_plan.SPLIT, window=window,
                          state=KernelState(split_rows=rows))
    assert_close_to_reference(out, query, kc, vc, batch, window)
    alone = paged_attention(query, kc, vc, batch, backend="cpu", window=window)
    for i, r in enumerate(runs):                       # the C++ kernel's rows: bitwise its own result
        if 0 < r <= rows:
            assert torch.equal(out[cu_q[i]: cu_q[i + 1]], alone[cu_q[i]: cu_q[i + 1]])


def test_a_split_step_needs_both_kinds_of_run_and_the_stores_bound():
    batch = step_backends._batch(1, 16)
    with pytest.raises(ValueError, match="split_rows"):
        kernel_plan.plan(batch, 16, kernel_plan.SPLIT)
    with pytest.raises(ValueError, match="needs runs of at most 1 query rows and longer ones"):
        kernel_plan.plan(batch, 16, kernel_plan.SPLIT, state=KernelState(split_rows=1))


@pytest.mark.measured_backends
def test_auto_on_the_cpu_measures_its_rule_once_and_features_keep_torch(monkeypatch):
    model = FAMILIES["llama"]()
    store = SessionStore(model, 256, chunk_size=16)
    rule = store.step_backends
    assert [r for r, _, _ in rule.measured] == list(step_backends.ROWS)
    assert all(t > 0 and c > 0 for _, t, c in rule.measured)
    assert store.attn_backend == rule.long and SessionStore(model, 256, chunk_size=16).step_backends is rule
    assert SessionStore(model, 256, chunk_size=16, layerwise_kv=True,
                        host_capacity=256).step_backends == StepBackends("torch")
    assert SessionStore(model, 256, chunk_size=16, attn_backend="torch").step_backends == StepBackends("torch")
    assert SessionStore(model.to(torch.bfloat16), 256, chunk_size=16).step_backends == StepBackends("cpu")
    monkeypatch.setattr(step_backends.cpu_backend, "available", lambda device: False)   # no compiler
    step_backends.measure.cache_clear()
    try:
        assert step_backends.measure(4, 2, 16, 16, torch.float32, 2, 1) == StepBackends("torch")
    finally:
        step_backends.measure.cache_clear()


@pytest.mark.parametrize("make_model", [lambda: FAMILIES["llama"](), lambda: FAMILIES["opt"](),
                                        lambda: tiny_gemma2()], ids=["llama", "opt", "gemma2"])
def test_the_engine_is_exact_on_split_steps(make_model, monkeypatch):
    """Decodes beside prefill chunks (a small token budget, prompts of several lengths), the decodes through the
    C++ kernel and the prefills through torch in one step, give stateless generate's tokens. Control: the count of
    split plans is 0 with a rule that never splits."""
    made = []
    original = kernel_plan.SplitPlan.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(kernel_plan.SplitPlan, "__init__", counted)
    for rule, splits in ((StepBackends("torch"), False), (StepBackends("torch", "cpu", 1), True)):
        monkeypatch.setattr(session_store, "measure_step_backends", lambda *args, rule=rule: rule)
        made.clear()
        model, oracle = make_model(), make_model()
        engine = Engine(model, device_capacity=512, chunk_size=16, max_batch_tokens=24)
        assert engine.store.step_backends is rule
        convs = {f"s{i}": Conversation(seed=700 + i, first=8 + 9 * i) for i in range(4)}
        for _ in range(2):
            engine_round(engine, convs, oracle, 6)
            engine.store.check_integrity()
        engine.stop()
        assert bool(made) is splits, len(made)


def test_a_model_free_store_attends_every_step_with_its_backend_and_refuses_a_rule_that_does_not_fall_back_to_it():
    from stateful_hf.cache import KVSpec, KVStore
    spec = KVSpec(2, 2, 16, block_size=16)
    assert KVStore(spec, 256).step_backends == StepBackends("torch")
    assert KVStore(spec, 256, step_backends=StepBackends("torch", "cpu", 4)).planner.backends.short_rows == 4
    with pytest.raises(ValueError, match="must fall back to the store's backend 'torch'"):
        KVStore(spec, 256, step_backends=StepBackends("cpu"))
    with pytest.raises(ValueError, match="layerwise_kv"):     # a short backend that cannot serve the store
        KVStore(spec, 256, step_backends=StepBackends("torch", "cpu", 4), layerwise_kv=True, host_capacity=256)


@pytest.mark.parametrize("times, want", [
    # (torch or the split step, the C++ kernel) per measured step: rows 1 (warm-up, dropped), 1, 4, 16, 64, 256
    ([(1, 1), (0.5, 1), (9, 1), (9, 1), (9, 1), (9, 1)], ("torch", None, 0)),             # torch wins decodes
    ([(1, 1), (0.95, 1), (0.95, 1), (0.95, 1), (0.95, 1), (0.95, 1)], ("cpu", None, 0)),  # never clearly faster
    ([(1, 1), (2, 1), (0.5, 1), (2, 1), (2, 1), (2, 1)], ("torch", "cpu", 1)),            # the split wins at 4
    ([(1, 1), (2, 1), (2, 1), (0.8, 1), (0.1, 1), (0.1, 1)], ("torch", "cpu", 4)),        # at 16
    ([(1, 1), (2, 1), (2, 1), (2, 1), (2, 1), (0.5, 1)], ("torch", "cpu", 64)),           # at 256 only
])
def test_the_rule_follows_the_measured_times(monkeypatch, times, want):
    seconds = iter(times)
    monkeypatch.setattr(step_backends, "_step_seconds", lambda *args: list(next(seconds)))
    step_backends.measure.cache_clear()
    try:
        rule = step_backends.measure(4, 2, 16, 16, torch.float32, 2, 1)
    finally:
        step_backends.measure.cache_clear()
    assert (rule.long, rule.short, rule.short_rows) == want
    assert [r for r, _, _ in rule.measured] == list(step_backends.ROWS)


def test_the_suites_stores_split_decodes_from_prefills_by_scripted_times():
    """conftest's scripted times: every float32 CPU store of the suite gets the same split rule, not a timed one."""
    store = SessionStore(FAMILIES["llama"](), 256, chunk_size=16)
    assert (store.step_backends.long, store.step_backends.short, store.step_backends.short_rows) == ("torch", "cpu", 1)
    assert [c for _, _, c in store.step_backends.measured] == [1.0] * len(step_backends.ROWS)
