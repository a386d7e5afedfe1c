"""The continuous-batching engine: exact against stateless generate under concurrency, mixed steps,
suspension, cancellation and failures. Every engine's store is integrity-checked when idle."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.engine import RequestFailed


@pytest.fixture
def make_engine():
    engines = []

    def make(model, **kwargs):
        engine = Engine(model, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()
        assert not engine.has_work()
        engine.store.check_integrity()
        assert not any(engine.store.session(s).busy for s in engine.store.session_ids()), "a session left busy"


def expected(oracle, ids: list[int], n: int, **kwargs) -> list[int]:
    """Stateless greedy generate on the whole conversation. The explicit all-ones mask matters: a
    reply may contain token 0 (= pad_token_id), which generate would otherwise mask out."""
    x = torch.tensor([ids])
    return greedy(oracle, x, n, attention_mask=torch.ones_like(x), **kwargs)[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_24_sessions_4_turns_threads_exact(family, make_engine):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    # 24 sessions grow to ~95 tokens each (~2300 in all); the device holds 512.
    engine = make_engine(model, device_capacity=512, chunk_size=16, max_batch_tokens=128).start()
    n_new, turns = 6, 4
    record: dict[str, list[tuple[list[int], list[int]]]] = {}
    errors = []

    def user(i: int) -> None:
        sid, conv = f"{family}-{i}", Conversation(seed=100 + i, first=20 + i % 5)
        try:
            for _ in range(turns):
                ids = conv.ids[0].tolist()
                out = engine.submit(sid, ids, SamplingParams(max_new_tokens=n_new)).result(timeout=300)
                record.setdefault(sid, []).append((ids, list(out.token_ids)))
                conv.reply(torch.tensor([ids + list(out.token_ids)]))
        except BaseException as e:      # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    engine.stop()
    engine.store.check_integrity()
    stats = engine.stats()
    assert stats.finished_requests == 24 * turns
    assert stats.recomputed_tokens > 0, "capacity was meant to force recomputation"
    assert max(s.num_decode for s in engine.steps) > 1
    for sid, turns_ in record.items():
        for ids, got in turns_:
            assert got == expected(oracle, ids, n_new), (sid, len(ids))


def test_one_step_mixes_prefill_decode_and_recompute(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=1024, chunk_size=16, max_batch_tokens=256)
    old = Conversation(seed=7, first=40).ids[0].tolist()
    first = engine.submit("old", old, SamplingParams(max_new_tokens=4)).result()
    engine.store.evict("old")                              # its KV is gone: the next turn recomputes it
    history = old + list(first.token_ids)
    returning = history + [5, 6, 7, 8, 9]
    a_ids = Conversation(seed=8).ids[0].tolist()
    a = engine.submit("a", a_ids, SamplingParams(max_new_tokens=8))
    engine.step()                                          # a's prefill; a now decodes
    b_ids = Conversation(seed=9, first=30).ids[0].tolist()
    b = engine.submit("b", b_ids, SamplingParams(max_new_tokens=5))
    o = engine.submit("old", returning, SamplingParams(max_new_tokens=5))
    mixed = engine.step()
    rows = {sid: (rec, new, sampled) for sid, rec, new, sampled in mixed.entries}
    assert rows["a"] == (0, 1, True)                       # decode
    assert rows["b"] == (0, len(b_ids), True)              # prefill of a new session
    kept = len(history) - 1                                # the last reply token was never fed
    assert rows["old"] == (kept, len(returning) - kept, True)   # recomputed prefix + new prompt
    assert a.result().token_ids == tuple(expected(oracle, a_ids, 8))
    assert b.result().token_ids == tuple(expected(oracle, b_ids, 5))
    out = o.result()
    assert out.token_ids == tuple(expected(oracle, returning, 5))
    assert out.metrics.recomputed_tokens == kept and out.metrics.reused_tokens == 0


def test_chunked_prefill_and_suspension_exact(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    # 10 blocks of 16 tokens; three requests that end near 3-4 blocks each cannot all stay.
    engine = make_engine(model, device_capacity=160, chunk_size=16, max_batch_tokens=32, reserve_fraction=0.0)
    prompts = [Conversation(seed=20 + i, first=n).ids[0].tolist() for i, n in enumerate((40, 33, 45))]
    outs = engine.generate(["x", "y", "z"], prompts, SamplingParams(max_new_tokens=14))
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == tuple(expected(oracle, p, 14))
    assert max(s.num_tokens for s in engine.steps) <= 32
    assert sum(o.metrics.suspensions for o in outs) > 0
    suspended = [o for o in outs if o.metrics.suspensions]
    assert all(o.metrics.recomputed_tokens > 0 for o in suspended)


def test_cancel_mid_stream_leaves_others_intact(make_engine):
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    engine = make_engine(model, device_capacity=1024, chunk_size=16).start()
    prompts = {f"s{i}": Conversation(seed=30 + i).ids[0].tolist() for i in range(4)}
    handles = {sid: engine.submit(sid, p, SamplingParams(max_new_tokens=12, ignore_eos=True))
               for sid, p in prompts.items()}
    streamed = []
    for tok in handles["s1"]:
        streamed.append(tok)
        if len(streamed) == 3:
            handles["s1"].cancel()
    cancelled = handles["s1"].result()
    assert cancelled.finish_reason == "cancelled" and 3 <= len(cancelled.token_ids) < 12
    assert list(cancelled.token_ids[:3]) == streamed[:3]
    for sid in ("s0", "s2", "s3"):
        p = prompts[sid]
        assert list(handles[sid].result().token_ids) == expected(oracle, p, 12, eos_token_id=None)
    engine.stop()
    engine.store.check_integrity()
    assert not engine.store.session("s1").busy
    # The cancelled session takes a next turn normally.
    again = prompts["s1"] + [7, 8, 9]
    out = engine.submit("s1", again, SamplingParams(max_new_tokens=6)).result()
    assert list(out.token_ids) == expected(oracle, again, 6)


def test_failing_requests_get_clear_errors_only_on_their_handle(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=256, chunk_size=16).start()
    good = Conversation(seed=40).ids[0].tolist()
    ok = engine.submit("good", good, SamplingParams(max_new_tokens=8))
    bad = {
        "vocab": engine.submit("bad1", [5, 6, 10_000]),
        "empty": engine.submit("bad2", []),
        "float": engine.submit("bad3", torch.tensor([1.5, 2.0])),
        "text-without-tokenizer": engine.submit("bad4", "hello"),
        "too-long-for-device": engine.submit("bad5", list(range(3, 303))),   # 300 tokens > 256 on device
    }
    messages = {"vocab": "invalid token ids", "empty": "empty prompt", "float": "integer token ids",
                "text-without-tokenizer": "need a tokenizer", "too-long-for-device": "device_capacity"}
    for name, h in bad.items():
        with pytest.raises(RequestFailed, match=messages[name]):
            h.result(timeout=60)
        assert h.output().finish_reason == "error"
    assert list(ok.result().token_ids) == expected(oracle, good, 8)
    assert isinstance(bad["too-long-for-device"].output().error, stateful_hf.CapacityError)


def test_busy_session_waits_or_is_refused(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=512, chunk_size=16)
    p1 = Conversation(seed=50).ids[0].tolist()
    p2 = p1[:10] + [9, 9, 9]                       # an edit of the same conversation
    h1 = engine.submit("s", p1, SamplingParams(max_new_tokens=6))
    h2 = engine.submit("s", p2, SamplingParams(max_new_tokens=6))
    assert list(h2.result().token_ids) == expected(oracle, p2, 6)
    assert list(h1.result().token_ids) == expected(oracle, p1, 6)
    assert h1.output().metrics.latency < h2.output().metrics.latency   # serial, never interleaved
    assert h2.output().metrics.truncated_tokens > 0 and h2.output().metrics.reused_tokens == 10
    refusing = make_engine(FAMILIES["llama"](), device_capacity=512, on_busy="refuse")
    r1 = refusing.submit("s", p1, SamplingParams(max_new_tokens=3))
    r2 = refusing.submit("s", p2, SamplingParams(max_new_tokens=3))
    with pytest.raises(RequestFailed, match="busy"):
        r2.result()
    assert isinstance(r2.output().error, stateful_hf.SessionBusyError)
    assert len(r1.result().token_ids) == 3


def test_a_failing_forward_fails_only_its_step_and_the_engine_goes_on(make_engine, monkeypatch):
    from stateful_hf.engine import runner

    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    engine = make_engine(model, device_capacity=512, chunk_size=16)
    real, calls = runner.run_step, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_step", flaky)
    p = Conversation(seed=70).ids[0].tolist()
    doomed = engine.submit("a", p, SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestFailed, match="injected"):
        doomed.result()
    engine.store.check_integrity()
    assert engine.store.session("a").num_tokens == 0          # the aborted step's tokens were taken back
    out = engine.submit("a", p, SamplingParams(max_new_tokens=4)).result()
    assert list(out.token_ids) == expected(oracle, p, 4)


def test_stop_with_cancel_releases_everything(make_engine):
    engine = make_engine(FAMILIES["opt"](), device_capacity=512, chunk_size=16)
    handles = [engine.submit(f"s{i}", Conversation(seed=i).ids[0].tolist(), SamplingParams(max_new_tokens=50))
               for i in range(3)]
    engine.step()
    engine.stop(cancel=True)
    assert all(h.result().finish_reason == "cancelled" for h in handles)
    assert not engine.has_work()


def test_returning_session_swaps_in_from_the_host_tier(make_engine):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = stateful_hf.SessionStore(model, 512, chunk_size=16, host_capacity=2048)
    engine = make_engine(model, store=store)
    p = Conversation(seed=75, first=40).ids[0].tolist()
    first = engine.submit("h", p, SamplingParams(max_new_tokens=4)).result()
    store.evict("h")                                       # with a host tier: moved down, not dropped
    again = p + list(first.token_ids) + [5, 6, 7]
    out = engine.submit("h", again, SamplingParams(max_new_tokens=5)).result()
    assert list(out.token_ids) == expected(oracle, again, 5)
    kept = len(p) + 3
    assert out.metrics.reused_tokens == kept and out.metrics.recomputed_tokens == 0
    assert out.metrics.swapped_tokens == kept


def test_warm_up_runs_a_throwaway_turn_and_forgets_it():
    """`Engine.warm_up` (a server's, before /health): one throwaway turn through the running loop, its session
    deleted and its totals forgotten, so the first request's step does not pay the loop's one-time set-up; the
    turns after it are exact."""
    from conftest import engine_round

    from stateful_hf.testing import tiny_llama

    model, oracle = tiny_llama(), tiny_llama()
    with Engine(model, max_batch_tokens=64) as engine:
        ran, forget = [], engine.stepper.forget_totals
        engine.stepper.forget_totals = lambda: (ran.append(engine.stepper.totals.steps), forget())
        engine.warm_up()
        stats = engine.stats()
        assert (stats.steps, stats.finished_requests, stats.generated_tokens) == (0, 0, 0)
        assert list(engine.store.session_ids()) == []
        # control: it ran a turn (a prefill and a decode step), settled the thread team, ran it again, then forgot it
        assert ran == [4 if engine.thread_sizer is not None else 2]
        engine_round(engine, {"w": Conversation(seed=5, first=30)}, oracle, n=4)
        assert engine.stats().finished_requests == 1
