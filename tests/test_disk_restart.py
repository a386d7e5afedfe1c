"""A restart keeps every conversation: the flush on close and write-behind copy the device and host
tiers' chunks to disk (docs/durability.md, "What a restart keeps"). Every returning turn after a
reopen is compared with stateless `generate` (float32, tiny model) and must reuse what was flushed;
check_integrity() holds after each step, including the rule for a chunk held in two tiers."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy

import stateful_hf
from stateful_hf.cache import CostProfile

KW = {"device_capacity": 256, "host_capacity": 128, "chunk_size": 16, "cost_profile": CostProfile(),
      "policy": "lru"}
_MODELS: dict = {}


def models():
    if "llama" not in _MODELS:
        _MODELS["llama"] = (FAMILIES["llama"](), FAMILIES["llama"]())
    return _MODELS["llama"]


def open_store(model, directory, capacity="4MiB", **kw):
    return stateful_hf.SessionStore(model, disk_dir=directory, disk_capacity=capacity, **{**KW, **kw})


def play(store, convs, oracle, n=5):
    """One exact turn of each conversation; returns {sid: its TurnStats}."""
    turns = {}
    for sid, conv in convs.items():
        out = greedy(store.model, conv.ids, n=n, cache=store.cache(sid))
        assert torch.equal(out, greedy(oracle, conv.ids, n=n)), sid
        conv.reply(out)
        turns[sid] = store.stats(sid).last_turn
        store.check_integrity()
    return turns


def conversations(n, first=37):
    return {f"s{i}": Conversation(seed=300 + i, first=first + 7 * i) for i in range(n)}


def tiers_of(store, sid):
    return {c.state.value for c in store.session(sid).chunks}


def test_close_flushes_device_and_host_sessions_and_a_restart_reuses_them(tmp_path):
    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict", host_capacity=512)
    convs = conversations(6)
    play(store, convs, oracle)
    play(store, convs, oracle)               # 6 sessions of ~75 tokens on 256 device tokens: host too
    states = set().union(*(tiers_of(store, sid) for sid in convs))
    assert {"device", "host"} <= states, states              # the flush has both tiers to write
    assert store.stats().disk_tokens == 0
    held = {sid: store.num_tokens(sid) for sid in convs}
    report = store.close()
    assert report.chunks_left == 0 and report.tokens_written == sum(held.values()), report
    store = open_store(model, tmp_path / "d", disk_write="evict")
    store.check_integrity()
    assert store.stats().disk_tokens == sum(held.values())    # every token, partial last chunks included
    turns = play(store, convs, oracle)
    reused = sum(t.reused_tokens for t in turns.values())
    assert reused >= 0.99 * sum(held.values()), (reused, held)
    assert all(t.recomputed_tokens == 0 for t in turns.values()), turns
    store.close(flush=False)


def test_close_without_flush_keeps_todays_behaviour(tmp_path):
    """The negative control: close(flush=False) writes nothing of the device and host tiers, so a restart
    finds no session (the test above would fail without the flush)."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    convs = conversations(3)
    play(store, convs, oracle)
    assert store.close(flush=False) is None
    store = open_store(model, tmp_path / "d", disk_write="evict")
    assert store.session_ids() == []
    turns = play(store, convs, oracle)
    assert sum(t.reused_tokens for t in turns.values()) == 0
    store.close(flush=False)


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_a_flush_cut_short_by_its_budget_reopens_clean_and_exact(tmp_path, caplog, monkeypatch, budget):
    """No time at all (nothing written), or time for a few batches of 3 chunks (each slowed to 0.2 s): one
    log line says what is left; the reopened store is clean, reuses what was written, and is exact."""
    from stateful_hf.cache.disk import writer

    monkeypatch.setattr(writer, "FLUSH_BATCH", 3)
    slow = writer.DiskWriter._flush_batch
    monkeypatch.setattr(writer.DiskWriter, "_flush_batch", lambda self, b: (time.sleep(0.2), slow(self, b))[1])
    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict", host_capacity=512)
    convs = conversations(6)
    play(store, convs, oracle)
    held = sum(store.num_tokens(sid) for sid in convs)
    n_chunks = sum(len(store.session(sid).chunks) for sid in convs)
    with caplog.at_level(logging.WARNING, logger="stateful_hf.cache.disk"):
        report = store.close(timeout=budget)
    assert report.tokens_written + report.tokens_left == held, report
    assert report.chunks_written + report.chunks_left == n_chunks, report
    if budget == 0:
        assert report.chunks_written == 0, report
    else:
        assert 0 < report.chunks_written < n_chunks, report
    lines = [r.getMessage() for r in caplog.records if "disk flush left" in r.getMessage()]
    assert len(lines) == 1 and f"({report.tokens_left} tokens)" in lines[0] and "time budget" in lines[0], lines
    store = open_store(model, tmp_path / "d", disk_write="evict", host_capacity=512)
    store.check_integrity()
    assert store.stats().disk_tokens == report.tokens_written
    turns = play(store, convs, oracle)                       # the rest recomputed, exact
    assert sum(t.reused_tokens for t in turns.values()) >= report.tokens_written - 16 * len(convs)
    store.close(flush=False)


def test_a_flush_that_fits_part_keeps_the_most_recent_sessions(tmp_path, caplog):
    """A disk tier too small for everything: the flush writes the most recently active sessions first,
    says what it left, and the reopened store serves every session exactly (the left ones recomputed)."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", capacity=96, disk_write="evict")   # 6 slots of 16 tokens
    convs = conversations(4, first=20)
    play(store, convs, oracle)
    last = list(convs)[-1]
    with caplog.at_level(logging.WARNING, logger="stateful_hf.cache.disk"):
        report = store.close()
    assert report.chunks_written == 6 and report.chunks_left > 0, report
    assert any("disk flush left" in r.getMessage() and "disk tier full" in r.getMessage() for r in caplog.records)
    store = open_store(model, tmp_path / "d", capacity=96, disk_write="evict")
    store.check_integrity()
    assert store.residency(last).get("disk", 0) == store.num_tokens(last)     # the most recent one whole
    play(store, convs, oracle)
    store.close(flush=False)


def test_flush_after_a_partial_chunk_grew_rewrites_it(tmp_path):
    """A flushed partial last chunk whose session then goes on: its copy goes stale (another identity
    tag), the next flush writes the grown chunk, the old slot is freed through limbo; the restart is exact."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    convs = conversations(2)
    play(store, convs, oracle)
    first = store.flush()
    assert first.chunks_written > 0 and first.chunks_left == 0
    store.check_integrity()
    play(store, convs, oracle)                       # the partial chunks grow; new chunks too
    store.check_integrity()
    second = store.flush()
    assert second.chunks_written > 0 and second.chunks_left == 0, second
    store.check_integrity()
    held = {sid: store.num_tokens(sid) for sid in convs}
    store.close()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    turns = play(store, convs, oracle)
    assert all(turns[sid].reused_tokens == held[sid] for sid in convs), (turns, held)
    store.close(flush=False)


def test_engine_sessions_are_flushed_on_close(tmp_path):
    """Sessions served by the engine (device and host) are flushed by the store's close and reused exactly."""
    from conftest import engine_round

    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    engine = stateful_hf.Engine(model, store=store)
    convs = conversations(4)
    engine_round(engine, convs, oracle, 4)
    engine_round(engine, convs, oracle, 4)
    engine.stop()
    held = {sid: store.num_tokens(sid) for sid in convs}
    store.close()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    turns = play(store, convs, oracle)
    assert all(turns[sid].reused_tokens >= 0.99 * held[sid] for sid in convs), (turns, held)
    store.close(flush=False)


@pytest.mark.parametrize("flush", [10.0, None])
def test_engine_stop_flushes_and_a_restart_reuses_the_sessions(tmp_path, flush):
    """Engine.stop() writes what is not on disk (the server's SIGTERM path: `Replica.shutdown`); a store that is
    then dropped without its own flush (a process ending) reopens with every session. flush=None: the control,
    nothing written by the stop, nothing reused after it."""
    from conftest import engine_round

    model, oracle = models()
    store = open_store(model, tmp_path / "d", disk_write="evict")
    engine = stateful_hf.Engine(model, store=store)
    convs = conversations(3)
    engine_round(engine, convs, oracle, 4)
    engine.stop(flush=flush)
    held = {sid: store.num_tokens(sid) for sid in convs}
    store.close(flush=False)
    store = open_store(model, tmp_path / "d", disk_write="evict")
    turns = play(store, convs, oracle)
    if flush is None:
        assert all(turns[sid].reused_tokens == 0 for sid in convs), turns
    else:
        assert all(turns[sid].reused_tokens >= 0.99 * held[sid] for sid in convs), (turns, held)
    store.close(flush=False)


@pytest.fixture
def behind_store(tmp_path):
    model, _ = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=0.05)
    yield store
    store.close(flush=False)


def wait_written(store, n, seconds=20.0):
    """Wait until n copies are recorded; the stats are read under the store lock, so a batch the writer is
    recording (`written` counted, its commit and `batches` not yet) is read whole."""
    t0 = time.monotonic()
    while True:
        with store.writer.lock:
            if store.writer.stats.written >= n or time.monotonic() - t0 >= seconds:
                return store.writer.stats.written
        time.sleep(0.02)


def chunks_of(store, sids):
    return sum(len(store.session(sid).chunks) for sid in sids)


@pytest.mark.parametrize("emulate", [False, True])
def test_write_behind_keeps_the_sessions_without_a_flush(tmp_path, emulate):
    """Write-behind copies every session's chunks (the partial last ones too) soon after its turn, the
    serving copies staying on the device and host (disk_tokens stays 0: the copies overlap); a close
    without a flush then loses nothing. Under the async emulator too (device -> staging -> disk)."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=0.05, emulate_async=emulate, host_capacity=512)
    convs = conversations(4)
    play(store, convs, oracle)
    assert wait_written(store, chunks_of(store, convs)) == chunks_of(store, convs), store.writer.stats
    store.check_integrity()
    assert store.stats().disk_tokens == 0 and len(store.disk_state.copies) == chunks_of(store, convs)
    held = {sid: store.num_tokens(sid) for sid in convs}
    store.close(flush=False)
    store = open_store(model, tmp_path / "d", write_behind_delay=0.05, emulate_async=emulate, host_capacity=512)
    store.check_integrity()
    turns = play(store, convs, oracle)
    assert all(turns[sid].reused_tokens == held[sid] for sid in convs), (turns, held)
    store.close(flush=False)


def test_evicting_a_chunk_already_on_disk_writes_nothing(tmp_path, monkeypatch):
    from stateful_hf.cache.disk import index

    model, oracle = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=0.05, host_capacity=512)
    convs = conversations(2)
    play(store, convs, oracle)
    n = chunks_of(store, convs)
    assert wait_written(store, n) == n
    flushes = []
    monkeypatch.setattr(index, "durability_point", lambda name: flushes.append(name))
    before = store.counters.swapped_out_disk
    store.move("s0", range(len(store.session("s0").chunks)), "disk")
    assert "data-flush" not in flushes, flushes                      # no data written: onto its copies
    assert store.residency("s0").get("disk", 0) == store.num_tokens("s0")
    assert store.counters.swapped_out_disk - before == store.num_tokens("s0")
    store.check_integrity()
    play(store, convs, oracle)
    store.close(flush=False)


def test_a_stale_copy_is_never_served(tmp_path):
    """A partial last chunk copied, then grown by the next turn before write-behind runs again: its copy is
    stale (another identity tag); the index stops naming it, the restart serves the full chunks only."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=3600)
    convs = {"s0": Conversation(seed=7, first=40)}
    play(store, convs, oracle)                      # 45 tokens: 2 full chunks and a partial one
    store.writer.write_due(now=True)
    assert store.writer.stats.written == 3
    play(store, convs, oracle)                      # the partial chunk grows: its copy goes stale
    store.check_integrity()
    store.close(flush=False)
    store = open_store(model, tmp_path / "d", write_behind_delay=3600)
    assert store.num_tokens("s0") == 32               # ids up to the last valid copy's end
    turns = play(store, convs, oracle)
    assert turns["s0"].reused_tokens == 32
    store.close(flush=False)


def test_a_full_queue_skips_copies_and_never_blocks(tmp_path):
    """A queue of one chunk: copies that do not fit are skipped and counted, retried later, never waited for."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=0.05, write_behind_queue=16, host_capacity=512)
    convs = conversations(3)
    play(store, convs, oracle)
    n = chunks_of(store, convs)
    assert wait_written(store, n) == n
    assert store.writer.stats.skipped > 0 and store.writer.stats.batches >= n, store.writer.stats
    store.check_integrity()
    store.close(flush=False)


def test_a_failing_disk_during_write_behind_fails_no_turn(tmp_path, monkeypatch):
    """Every data flush fails: the copies are counted as failed, the tier degraded, the turns exact;
    the close's flush cannot write either and says so; the reopened store is exact."""
    from stateful_hf.cache.disk import index

    def fail(name):
        if name == "data-flush":
            raise OSError(5, "injected EIO")

    model, oracle = models()
    store = open_store(model, tmp_path / "d", write_behind_delay=3600)
    convs = conversations(2)
    monkeypatch.setattr(index, "durability_point", fail)
    play(store, convs, oracle)
    store.writer.write_due(now=True)
    assert store.writer.stats.failed > 0 and store.writer.stats.written == 0
    assert store.stats().disk_degraded
    store.check_integrity()
    play(store, convs, oracle)
    report = store.close()
    assert report.chunks_written == 0 and report.chunks_left > 0
    monkeypatch.undo()
    store = open_store(model, tmp_path / "d", write_behind_delay=3600)
    store.check_integrity()
    play(store, convs, oracle)
    store.close(flush=False)


def test_crash_at_the_write_behind_points(tmp_path):
    """The write-behind script (benchmarks/disk_faults.py `scripted_behind`, fresh interpreters) SIGKILLed
    at its points: a copy's data flush (6, 8, 10), the commit of a batch freeing a stale copy (9), the
    close's commit and flush (12, 13), a copy after the restart (15): every reopened directory serves
    every saved session exactly, and keeps every session whose copy had committed. (A step's or the eviction
    onto copies' change of the index that only frees slots into limbo waits for the writer's commit: no point.)
    `python -m benchmarks.disk_faults points --script behind` runs all 19."""
    from benchmarks.disk_faults import crash_sweep, finish_worker, start_worker
    from stateful_hf.testing import tiny_llama

    whole = start_worker(tmp_path / "count", script="behind")        # the whole run, beside the sweep's
    results = crash_sweep(tiny_llama(seed=0), (6, 8, 9, 10, 12, 13, 15), tmp_path, script="behind")
    code, lines = finish_worker(whole)
    names = [line.split()[2] for line in lines if line.startswith("point")]
    assert code == 0 and not any("WRONG" in line for line in lines), lines[-5:]
    assert [names[i - 1] for i in (6, 8, 9, 10, 12, 13, 15)] == ["data-flush", "data-flush", "index-commit",
                                                                 "data-flush", "index-commit", "data-flush",
                                                                 "data-flush"], names
    assert all(wrong == 0 for *_, wrong in results), results
    # before the first copy committed (6) nothing is saved; after it, s0 at least; after s1's, both. At 15
    # (after the restart, s0's turn done, its new copy not committed) both still: the swap-in kept s0's disk
    # slots as its chunks' copies (`DiskCopies.keep`), so the committed index still names them
    assert [turns for _, _, turns, _ in results] == [0, 1, 1, 1, 2, 2, 2], results
