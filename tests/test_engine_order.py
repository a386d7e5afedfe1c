"""The order of service within and between steps: decode tokens and short turns before long prefills,
one session's turns in submit order, and the loop's arrival and burst windows. Every output is exact against
stateless generate; every store is integrity-checked when idle."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import FAMILIES, greedy

from stateful_hf import Engine, SamplingParams
from stateful_hf.engine.scheduler import SchedulerConfig


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected(oracle, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt])
    return greedy(oracle, x, n, attention_mask=torch.ones_like(x))[0, len(prompt):].tolist()


def idle_and_sound(engine: Engine) -> None:
    engine.stop()
    assert not engine.has_work()
    engine.store.check_integrity()
    assert not any(engine.store.session(s).busy for s in engine.store.session_ids())


def first_token_step(engine: Engine, sid: str, after: int = -1) -> int:
    """Index of the first step after `after` in which `sid` sampled a token."""
    return min(r.index for r in engine.steps if r.index > after for e in r.entries if e[0] == sid and e[3])


def steps_with_rows(engine: Engine, sid: str) -> list[int]:
    return [r.index for r in engine.steps for e in r.entries if e[0] == sid and e[1] + e[2] > 1]


@pytest.mark.parametrize("short", [None, 0])
def test_a_returning_turn_does_not_wait_behind_a_long_prefill(short):
    """Session 'ret' had a turn; session 'long' sends a 400-token prompt (10 chunks of 40 rows at
    max_batch_tokens 48). Then 'ret' sends its next 10-token message. Served short-first (the
    default), 'ret' gets its first token in the very next step, while 'long' is still prefilling,
    and 'long' keeps progressing in every step; in plain arrival order (short_prefill_tokens=0) it
    waits until 'long' has prefilled. Both exact either way."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, device_capacity=2048, chunk_size=16, max_batch_tokens=48, short_prefill_tokens=short)
    first = ids(1, 30)
    out1 = engine.generate(["ret"], [first], SamplingParams(max_new_tokens=4))[0]
    assert list(out1.token_ids) == expected(oracle, first, 4)
    long_prompt = ids(2, 400)
    h_long = engine.submit("long", long_prompt, SamplingParams(max_new_tokens=5))
    engine.step()
    engine.step()                                   # 'long' is two chunks in
    second = first + list(out1.token_ids) + ids(3, 10)
    h_ret = engine.submit("ret", second, SamplingParams(max_new_tokens=5))
    submitted_after = engine.steps[-1].index
    while not (h_long.done and h_ret.done):
        engine.step()
    ret_first, long_first = first_token_step(engine, "ret", submitted_after), first_token_step(engine, "long")
    if short is None:
        assert ret_first == submitted_after + 1
        assert ret_first < long_first
        long_steps = steps_with_rows(engine, "long")
        assert long_steps == list(range(long_steps[0], long_steps[-1] + 1))   # never starved
    else:
        assert ret_first >= long_first > submitted_after + 5      # behind the whole long prefill
    assert list(h_ret.result().token_ids) == expected(oracle, second, 5)
    assert list(h_long.result().token_ids) == expected(oracle, long_prompt, 5)
    idle_and_sound(engine)


def test_many_short_turns_leave_a_running_long_prefill_a_chunk():
    """Eight returning sessions' short turns arrive together while a long prefill runs: they are all
    served first (some split over two steps), but the long prefill still gets at least one chunk in
    each of those steps."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, device_capacity=4096, chunk_size=16, max_batch_tokens=64, short_prefill_tokens=16)
    firsts = {f"r{i}": ids(10 + i, 20) for i in range(8)}
    outs = engine.generate(list(firsts), list(firsts.values()), SamplingParams(max_new_tokens=3))
    long_prompt = ids(2, 600)
    h_long = engine.submit("long", long_prompt, SamplingParams(max_new_tokens=4))
    engine.step()
    submitted_after = engine.steps[-1].index
    seconds = {sid: p + list(o.token_ids) + ids(30 + i, 12) for i, ((sid, p), o) in
               enumerate(zip(firsts.items(), outs))}
    hs = {sid: engine.submit(sid, p, SamplingParams(max_new_tokens=4)) for sid, p in seconds.items()}
    while not (h_long.done and all(h.done for h in hs.values())):
        engine.step()
    long_steps = steps_with_rows(engine, "long")
    assert long_steps == list(range(long_steps[0], long_steps[-1] + 1))
    # 8 turns of 13 rows, 48 of each step's 64 rows set aside for them: all first tokens within 3 steps
    assert max(first_token_step(engine, sid, submitted_after) for sid in hs) <= submitted_after + 3
    assert long_steps[-1] > submitted_after + 6
    for sid, h in hs.items():
        assert list(h.result().token_ids) == expected(oracle, seconds[sid], 4)
    assert list(h_long.result().token_ids) == expected(oracle, long_prompt, 4)
    idle_and_sound(engine)


@pytest.mark.parametrize("window", [0.5, 0.0])
def test_the_arrival_window_lets_a_next_turn_join_the_next_step(window):
    """A client submits its next turn 20 ms after its answer is complete, while another session
    keeps the loop busy with steps of >= 0.3 s (a slowed forward). With an arrival window (capped
    at a tenth of the step: 30 ms here) the loop waits for it, and the turn is in the step right
    after; without one it misses that step. Exact either way."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, device_capacity=2048, chunk_size=16, max_batch_tokens=64, arrival_window=window)
    execute = engine.runner.execute

    def slow(items):
        time.sleep(0.3)
        return execute(items)

    engine.runner.execute = slow
    busy = ids(5, 20)
    first = ids(1, 20)
    second: list[int] = []
    outs: list[list[int]] = []
    done = threading.Event()

    def client():
        out = engine.submit("a", first, SamplingParams(max_new_tokens=2)).result(timeout=60)
        time.sleep(0.02)
        second.extend(first + list(out.token_ids) + ids(3, 8))
        outs.extend([list(out.token_ids), list(engine.submit("a", second, SamplingParams(max_new_tokens=2))
                                               .result(timeout=60).token_ids)])
        done.set()

    with engine:
        h_busy = engine.submit("busy", busy, SamplingParams(max_new_tokens=12))
        t = threading.Thread(target=client)
        t.start()
        t.join(timeout=120)
        assert done.is_set()
        h_busy.result(timeout=120)
    ended = first_token_step(engine, "a", first_token_step(engine, "a"))    # the step of a's 2nd token
    joined = first_token_step(engine, "a", ended)                           # a's next turn's first token
    assert (joined == ended + 1) == (window > 0)
    assert list(h_busy.result().token_ids) == expected(oracle, busy, 12)
    assert outs[0] == expected(oracle, first, 2) and outs[1] == expected(oracle, second, 2)
    idle_and_sound(engine)


def test_scheduler_config_checks_short_prefill_tokens():
    assert SchedulerConfig(256).short_rows == 64
    assert SchedulerConfig(256, short_prefill_tokens=0).short_rows == 0
    with pytest.raises(ValueError, match="short_prefill_tokens"):
        SchedulerConfig(256, short_prefill_tokens=-1)
    with pytest.raises(ValueError, match="arrival_window"):
        Engine(FAMILIES["llama"](), device_capacity=512, arrival_window=-0.1)


@pytest.mark.parametrize("window", [0.5, 0.0])
def test_a_burst_on_an_idle_engine_starts_in_one_step(window):
    """Three clients submit 40 ms apart to an idle, started engine. With an arrival window of 0.5 s
    (a burst ends after 0.1 s without a submission) the loop, woken by the first, waits for the
    others and the first step holds all three; without one the first step holds only the first.
    Exact either way."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, device_capacity=2048, chunk_size=16, max_batch_tokens=128, arrival_window=window)
    prompts = {f"c{i}": ids(10 + i, 12) for i in range(3)}
    with engine:
        handles = {}
        for sid, p in prompts.items():
            handles[sid] = engine.submit(sid, p, SamplingParams(max_new_tokens=3))
            time.sleep(0.04)
        outs = {sid: list(h.result(timeout=60).token_ids) for sid, h in handles.items()}
    first = {e[0] for e in engine.steps[0].entries}
    assert first == (set(prompts) if window > 0 else {"c0"})
    for sid, p in prompts.items():
        assert outs[sid] == expected(oracle, p, 3)
    idle_and_sound(engine)


def test_await_burst_waits_while_submissions_keep_coming():
    """`RequestRegistry.await_burst(gap, limit)`: returns `gap` after the last submission, and by
    `limit` while they keep coming."""
    engine = Engine(FAMILIES["llama"](), device_capacity=512)   # never started: nothing steps
    reg = engine.requests

    def submit_every(delay: float, n: int) -> None:
        for i in range(n):
            time.sleep(delay)
            engine.submit(f"b{i}", ids(i, 4), SamplingParams(max_new_tokens=1))

    t0 = time.monotonic()
    reg.await_burst(0.05, 5.0)                       # nothing comes: one gap
    assert 0.05 <= time.monotonic() - t0 < 1.0
    t = threading.Thread(target=submit_every, args=(0.01, 5))
    t0 = time.monotonic()
    t.start()
    reg.await_burst(0.3, 5.0)                        # 5 submissions 10 ms apart, then 0.3 s quiet
    waited = time.monotonic() - t0
    t.join()
    assert 0.35 <= waited < 2.0
    t0 = time.monotonic()
    t = threading.Thread(target=submit_every, args=(0.02, 40))
    t.start()
    reg.await_burst(0.3, 0.2)                        # submissions keep coming: the limit ends it
    assert 0.2 <= time.monotonic() - t0 < 0.5
    t.join()


def test_a_sessions_turns_run_in_submit_order_even_when_the_later_is_short():
    """Two turns queued for one session, a long one then a short one (`on_busy="wait"`: the second
    waits for the first): they run in submit order, since short turns go first across sessions only.
    Run out of order, the session would keep the earlier turn's conversation, and its next turn
    (continuing the later one) would find a divergent history and recompute it."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = Engine(model, chunk_size=8, device_capacity=1024, max_batch_tokens=64)
    long, short = list(range(3, 103)), list(range(200, 210))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    h1, h2 = engine.submit("a", long, params), engine.submit("a", short, params)
    while engine.has_work():
        engine.step()
    o1, o2 = h1.output(), h2.output()
    for prompt, out in ((long, o1), (short, o2)):
        assert list(out.token_ids) == greedy(oracle, torch.tensor([prompt]), n=3)[0, len(prompt):].tolist()
    first_token = [o.metrics.arrival_time + o.metrics.ttft for o in (o1, o2)]
    assert first_token[0] < first_token[1]
    assert list(engine.store.session("a").token_ids) == short + list(o2.token_ids[:-1])     # the later turn's
    more = short + list(o2.token_ids) + [7, 8, 9]
    out = engine.submit("a", more, params).result()
    assert list(out.token_ids) == greedy(oracle, torch.tensor([more]), n=3)[0, len(more):].tolist()
    assert out.metrics.recomputed_tokens == 0 and out.metrics.reused_tokens == len(more) - 4
    engine.store.check_integrity()
