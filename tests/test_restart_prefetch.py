"""The first returning turn after a restart (issue 53): its disk chunks move up, which frees their slots into
limbo; with write-behind that change is committed by the writer after the turn (`DiskWriter.sync`), not by the
turn's first step (one SQLite transaction with an fsync: ~20 ms for a process's first, measured on that step).
Every turn equals stateless `generate` (float32, tiny model); check_integrity() holds; a restart after a crash
before the deferred commit serves the sessions exactly (the committed index stayed true)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy

import stateful_hf
from stateful_hf.cache import CostProfile
from stateful_hf.cache.disk import index as disk_index

KW = {"device_capacity": 512, "chunk_size": 16, "cost_profile": CostProfile(), "policy": "lru"}


@pytest.fixture(scope="module")
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def open_store(model, directory, **kw):
    return stateful_hf.SessionStore(model, disk_dir=directory, disk_capacity="4MiB", **{**KW, **kw})


def turn(store, oracle, sid, conv, n=4):
    out = greedy(store.model, conv.ids, n=n, cache=store.cache(sid))
    assert torch.equal(out, greedy(oracle, conv.ids, n=n)), sid
    conv.reply(out)
    store.check_integrity()
    return store.stats(sid).last_turn


@pytest.fixture
def commits(monkeypatch):
    """The index commits, by thread name."""
    seen: list[str] = []
    real = disk_index.durability_point

    def point(name):
        if name == "index-commit":
            seen.append(threading.current_thread().name)
        real(name)

    monkeypatch.setattr(disk_index, "durability_point", point)
    return seen


def saved(model, oracle, directory, n=3):
    convs = {f"s{i}": Conversation(seed=500 + i, first=40 + 5 * i) for i in range(n)}
    store = open_store(model, directory, disk_write="evict")
    for sid, conv in convs.items():
        turn(store, oracle, sid, conv)
    store.close()                                    # the flush: every session on disk
    return convs


@pytest.mark.parametrize("mode", ["behind", "evict"])
def test_the_first_returning_turn_commits_nothing_on_its_path(tmp_path, models, commits, mode):
    """behind: the returning turns (chunks moved up from disk) commit no index transaction in the turn's thread;
    the writer commits after them (counted in `writer.deferred`) and the committed index is the state's then.
    evict (the control: no writer thread): the same turns commit on their path."""
    model, oracle = models
    convs = saved(model, oracle, tmp_path / "d")
    store = open_store(model, tmp_path / "d", disk_write=mode, write_behind_delay=0.05)
    assert store.stats().disk_tokens > 0
    commits.clear()
    for sid, conv in convs.items():
        t = turn(store, oracle, sid, conv)
        assert t.recomputed_tokens == 0 and t.reused_tokens > 0, t
    on_path = [name for name in commits if name == threading.current_thread().name]
    if mode == "evict":
        assert on_path, commits
        store.close(flush=False)
        return
    assert not on_path, commits
    assert store.writer.deferred >= 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with store.writer.lock:
            if not store.disk_state.pending:
                break
        time.sleep(0.02)
    with store.writer.lock:
        assert not store.disk_state.pending
    store.check_integrity()                          # the committed index is the state's again
    store.close(flush=False)


def test_a_crash_before_the_deferred_commit_reopens_exact(tmp_path, models):
    """The returning turns' deferred commit never happens (write-behind's delay of an hour, a close without the
    flush or the final commit: a kill -9): the committed index still names the moved-up chunks' slots (limbo, not
    rewritten), so the restarted store serves every session exactly, from disk."""
    model, oracle = models
    convs = saved(model, oracle, tmp_path / "d")
    store = open_store(model, tmp_path / "d", write_behind_delay=3600.0)
    held = {sid: store.num_tokens(sid) for sid in convs}
    for sid, conv in convs.items():
        turn(store, oracle, sid, conv)
    with store.writer.lock:
        assert store.disk_state.pending               # the deferred commit has not run
    store.writer.stop()
    store.writer.disk.close()                         # what a kill -9 leaves: the last committed index
    store = open_store(model, tmp_path / "d", write_behind_delay=3600.0)
    store.check_integrity()
    for sid, conv in convs.items():
        t = turn(store, oracle, sid, conv)
        assert t.reused_tokens >= held[sid] - store.block_size and t.recomputed_tokens <= store.block_size, t
    store.close(flush=False)
