"""The engine's loop sizes its OpenMP team to the cores other processes leave free (thread_sizing.py)."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from conftest import FAMILIES, steady_threads

from stateful_hf import Engine, SamplingParams
from stateful_hf.engine import openmp
from stateful_hf.engine.thread_sizing import ThreadSizer


def scripted(others: list[float], cpus: int = 2) -> list[int]:
    """Team sizes a sizer picks when other processes use `others[i]` cores in window i of one second
    (this process uses 0.7 cores throughout, which must not count)."""
    samples = [(float(i), sum(others[:i]) + 0.7 * i, 0.7 * i) for i in range(len(others) + 1)]
    feed = iter(samples)
    sizer = ThreadSizer(max_threads=2, interval=0.0, usage=lambda: next(feed), cpus=cpus)
    assert sizer.current == 1                       # starts small: a full team beside busy work can take seconds
    return [sizer.threads() for _ in others]


def test_team_follows_free_cores_with_hysteresis():
    # idle host -> 2; a busy neighbour (1 core) -> 1; 0.3 core of noise does not grow it back (< 2 - 0.2 free);
    # once others use < 0.2 cores it grows again; 0.5 cores shrink it (free 1.5 < 2 - 0.4).
    assert scripted([0.0, 1.0, 0.3, 0.1, 0.5, 1.9, 0.0]) == [2, 1, 1, 2, 1, 1, 2]


def test_fixed_and_invalid_options():
    assert ThreadSizer.for_option(None) is None
    fixed = ThreadSizer.for_option(3)
    assert fixed.current == 3 and fixed.threads() == 3 and fixed.max_threads == 3
    assert ThreadSizer.for_option("auto").switch is not None and ThreadSizer.for_option("shrink").switch is None
    for bad in (0, -1, True, "two", 1.5):
        with pytest.raises(ValueError, match="step_threads"):
            ThreadSizer.for_option(bad)
    with pytest.raises(ValueError, match="step_threads"):
        Engine(FAMILIES["llama"](), device_capacity=256, chunk_size=16, step_threads="many")


@pytest.mark.skipif(torch.get_num_threads() < 2 or not openmp.set_thread_team(torch.get_num_threads()),
                    reason="needs torch on OpenMP with >= 2 threads")
def test_fit_sizes_only_a_claimed_threads_team():
    main = torch.get_num_threads()
    sizer = ThreadSizer(main, start=1)
    seen = {}

    def loop():
        seen["unclaimed"] = sizer.fit(64)
        sizer.claim()
        seen["fit"] = sizer.fit(64)
        seen["loop"] = torch.get_num_threads()

    th = threading.Thread(target=loop)
    th.start()
    th.join()
    assert seen == {"unclaimed": None, "fit": 1, "loop": 1}
    assert sizer.fit(64) is None and torch.get_num_threads() == main


def test_a_busy_host_shrinks_the_team_only_for_mid_sized_steps():
    # 2 cores, others busy on 1.5 of them: the free-core team is 1; "auto" runs steps of
    # shrink_rows on it and every other step on the full team, throttled; a quiet host: the full team spins
    usage = ((float(i), 1.5 * i, 0.0) for i in itertools.count())
    sizer = ThreadSizer(2, interval=0.0, usage=lambda: next(usage), cpus=2, switch=_Switch(),
                        shrink_rows=(16, 320))
    sizer.claim()
    assert [sizer.fit(r) for r in (8, 16, 319, 320)] == [2, 1, 1, 2]
    assert sizer.switch.calls == [True] * 4
    assert sizer.steps_by_threads == {"2 throttled": 2, "1": 2}
    sizer.current, sizer.interval = 2, float("inf")          # the host is quiet again
    assert sizer.fit(64) == 2 and sizer.switch.calls[-1] is False
    samples = iter([(0.0, 0.0, 0.0), None])        # /proc/stat unreadable later: the team stays
    flaky = ThreadSizer(2, interval=0.0, usage=lambda: next(samples), cpus=2, start=2)
    flaky.claim()
    assert flaky.fit(64) == 2
    shrink = ThreadSizer(2, interval=float("inf"), usage=lambda: None, cpus=2)
    shrink.claim()
    assert [shrink.fit(r) for r in (8, 64, 512)] == [1, 1, 1]


class _Switch:
    def __init__(self):
        self.calls = []

    def set(self, throttled: bool) -> None:
        self.calls.append(throttled)


def test_engine_with_a_sized_loop_stays_exact():
    model = FAMILIES["llama"]()
    ids = [5, 9, 13, 7, 22, 31, 4]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    for threads in ("auto", "shrink", 1, None):
        with Engine(model, device_capacity=256, chunk_size=16, step_threads=threads) as engine:
            out = engine.submit("s", ids, SamplingParams(max_new_tokens=6, ignore_eos=True)).result()
        assert list(out.token_ids) == ref
        engine.store.check_integrity()
        if threads is not None:
            assert sum(engine.thread_sizer.steps_by_threads.values()) == engine.stats().steps


@pytest.mark.skipif(not openmp.can_release() or torch.get_num_threads() < 2, reason="needs libgomp and >= 2 threads")
def test_spin_switch_holds_and_frees_a_ballast_pool():
    import os
    import time

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    steady_threads()                              # no thread of an earlier test exits inside the counts
    switch = openmp.SpinSwitch()
    switch.set(True)
    deadline = time.monotonic() + 10
    while not switch.throttled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert switch.throttled
    held = threads()                              # the switch's thread and its pool's worker
    switch.set(False)
    deadline = time.monotonic() + 10
    while switch.throttled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not switch.throttled and threads() == held - 1
    switch.close()
    deadline = time.monotonic() + 10
    while threads() != held - 2 and time.monotonic() < deadline:     # the OS thread exits just after join
        time.sleep(0.01)
    assert threads() == held - 2


@pytest.mark.skipif(not openmp.can_release() or torch.get_num_threads() < 2, reason="needs libgomp and >= 2 threads")
def test_a_spin_switch_is_applied_before_set_returns():
    """The step that asks for a mode runs in it: `set` returns once the switch's thread has taken or freed its
    ballast pool (bounded by `wait`), not while it still does so beside the step."""
    switch = openmp.SpinSwitch()
    try:
        for want in (True, False, True, False):
            switch.set(want, wait=10.0)
            assert switch.throttled is want
    finally:
        switch.close()
