"""The disk tier never serves wrong KV: after a capacity change, a failed flush or index commit, a
full filesystem, a damaged or missing file, a crash at any durability point, or a random SIGKILL.
Every turn after the fault is compared with stateless `generate`, and check_integrity() holds.
Crashes run in fresh interpreters (`benchmarks/disk_faults.py`), never a fork of this process."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import subprocess

import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round, greedy

import stateful_hf
from stateful_hf.cache import CostProfile, StoreError

PROFILE = CostProfile()
KW = {"device_capacity": 512, "host_capacity": 128, "chunk_size": 16, "cost_profile": PROFILE, "policy": "lru"}
_MODELS: dict = {}


def models(family="llama"):
    if family not in _MODELS:
        _MODELS[family] = (FAMILIES[family](), FAMILIES[family]())
    return _MODELS[family]


def open_store(model, directory, capacity=256, **kw):
    return stateful_hf.SessionStore(model, disk_dir=directory, disk_capacity=capacity, **{**KW, **kw})


def play(store, convs, oracle, sids=None, n=6):
    """One exact turn of each conversation; returns each turn's TurnStats."""
    model, turns = store.model, {}
    for sid in sids or list(convs):
        out = greedy(model, convs[sid].ids, n=n, cache=store.cache(sid))
        assert torch.equal(out, greedy(oracle, convs[sid].ids, n=n)), sid
        convs[sid].reply(out)
        turns[sid] = store.stats(sid).last_turn
    store.check_integrity()
    return turns


def all_to_disk(store, sids):
    for sid in sids:
        store.move(sid, range(len(store.session(sid).chunks)), "disk")
    store.check_integrity()


def stored(store, sid):
    """The session's chunks that hold KV somewhere (a move can take them)."""
    return [k for k, c in enumerate(store.session(sid).chunks) if c.state.value != "dropped"]


def conversations(n=2, first=50):
    return {f"s{i}": Conversation(seed=100 + i, first=first + 13 * i) for i in range(n)}


def kv_file(directory):
    (path,) = directory.glob("kv.*.bin")
    return path


# ---- 1. capacity changed between runs -------------------------------------------------------------

@pytest.mark.parametrize("second", [512, "1MiB", 64])
def test_capacity_change_relocates_and_stays_exact(second, tmp_path):
    model, oracle = models()
    d = tmp_path / "d"
    store = open_store(model, d, 256)                      # 16 slots of 16 tokens
    convs = conversations(2)
    play(store, convs, oracle)
    all_to_disk(store, convs)
    saved = {sid: store.session(sid).num_tokens for sid in convs}
    on_disk = store.stats().disk_tokens
    store.close()
    again = open_store(model, d, second)
    slots = again.tiers.disk.pool.num_blocks
    assert kv_file(d).stat().st_size == slots * again.spec.bytes_per_block     # preallocated at the new size
    assert again.stats().disk_capacity_tokens == slots * 16 != 256
    kept = again.stats().disk_tokens
    if slots * 16 >= on_disk:
        assert kept == on_disk
    else:                                                  # shrunk: the highest chunk indices stay
        assert sum(again.session(sid).residency(16)["disk"] > 0 for sid in convs) and \
            sum(c.state.value == "disk" for sid in convs for c in again.session(sid).chunks) == slots
        for sid in convs:
            ks = [k for k, c in enumerate(again.session(sid).chunks) if c.state.value == "disk"]
            assert ks == list(range(len(again.session(sid).chunks) - len(ks), len(again.session(sid).chunks)))
    again.check_integrity()
    before = {sid: again.residency(sid) for sid in convs}
    turns = play(again, convs, oracle)
    for sid in convs:
        assert turns[sid].swapped_in_disk == before[sid]["disk"]
        assert turns[sid].recomputed_tokens == saved[sid] - before[sid]["disk"]
    assert again.stats().disk_checksum_failures == 0
    for sid in convs:
        with contextlib.suppress(stateful_hf.CapacityError):      # 4 slots cannot hold a whole session
            again.move(sid, range(len(again.session(sid).chunks)), "disk")
    again.close()
    third = open_store(model, d, 256)                      # and back
    play(third, convs, oracle)
    third.close()


# ---- 2. a failed durability step never fails a turn ----------------------------------------------

class Faults:
    def __init__(self, monkeypatch, point):
        from stateful_hf.cache.disk import index as disk_index

        self.point, self.on, self.hits = point, True, 0
        monkeypatch.setattr(disk_index, "durability_point", self)

    def __call__(self, name):
        if self.on and name == self.point:
            self.hits += 1
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")


@pytest.mark.parametrize("point", ["index-commit", "data-flush"])
def test_failed_flush_or_commit_never_fails_a_turn(point, tmp_path, monkeypatch):
    model, oracle = models()
    d = tmp_path / "d"
    store = open_store(model, d, 96)                       # 6 slots: moves to disk push others out
    convs = conversations(3)
    play(store, convs, oracle)
    all_to_disk(store, ["s0"])
    faults = Faults(monkeypatch, point)
    for _ in range(3):
        play(store, convs, oracle)
        for sid in convs:
            with contextlib.suppress(StoreError):          # the operator's move may be refused, cleanly
                store.move(sid, stored(store, sid), "disk")
            store.check_integrity()
    st = store.stats()
    assert faults.hits and st.disk_degraded and st.disk_write_failures >= faults.hits
    assert "DEGRADED" in store.summary()
    # the index on disk is still a true state: a copy of the directory opens and serves exactly
    shutil.copytree(d, tmp_path / "copy")
    faults.on = False
    snapshot = open_store(model, tmp_path / "copy", 96)
    snapshot.check_integrity()
    for sid in snapshot.session_ids():
        ids = torch.tensor([list(snapshot.session(sid).token_ids) + [7, 8, 9]])
        assert torch.equal(greedy(model, ids, n=4, cache=snapshot.cache(sid)), greedy(oracle, ids, n=4))
    snapshot.close()
    # space is back: the next move retries, the tier recovers, every later turn is exact
    for sid in convs:
        with contextlib.suppress(stateful_hf.CapacityError):
            store.move(sid, stored(store, sid), "disk")
        play(store, convs, oracle, [sid])
    assert not store.stats().disk_degraded
    store.move("s2", range(len(store.session("s2").chunks) - 6, len(store.session("s2").chunks)), "disk")
    store.close()
    again = open_store(model, d, 96)
    assert again.stats().disk_tokens > 0
    play(again, convs, oracle)
    again.close()


def test_engine_turns_stay_exact_while_the_index_cannot_be_written(tmp_path, monkeypatch):
    model, oracle = models()
    store = open_store(model, tmp_path / "d", 96, device_capacity=256, host_capacity=None)
    engine = stateful_hf.Engine(model, store=store)
    convs = conversations(3, first=30)
    engine_round(engine, convs, oracle, n=5)
    faults = Faults(monkeypatch, "index-commit")
    for _ in range(3):
        for sid in convs:
            with contextlib.suppress(StoreError):
                store.move(sid, stored(store, sid), "disk")
        engine_round(engine, convs, oracle, n=5)      # device pressure moves chunks down to disk too
        store.check_integrity()
    # every failed commit was counted; whether the tier reads degraded at this moment depends on which of the
    # engine's and the writer's operations ran last (a commit that finds nothing to change succeeds, and then
    # check_integrity above proved the committed index is the state)
    assert faults.hits and store.stats().disk_write_failures >= faults.hits
    faults.on = False
    for _ in range(2):
        for sid in convs:
            with contextlib.suppress(stateful_hf.CapacityError):
                store.move(sid, stored(store, sid), "disk")
        engine_round(engine, convs, oracle, n=5)
    assert not store.stats().disk_degraded
    engine.stop()
    store.check_integrity()
    store.close()


def mappings(directory) -> list[str]:
    """This process's memory mappings of files under `directory` (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(directory) in line]


@pytest.mark.parametrize("hidden", [False, True])
def test_close_unmaps_the_data_files(tmp_path, hidden):
    """A closed store maps none of its disk files any more, while the store object itself lives on
    (no garbage collection needed: a tmpfs holding them can be unmounted at once)."""
    model, oracle = models()
    store = open_store(model, tmp_path / "d", **({"hidden_states": "always", "hidden_layers": 1} if hidden else {}))
    convs = conversations(2)
    play(store, convs, oracle)
    all_to_disk(store, convs)
    assert mappings(tmp_path / "d"), "the disk tier maps its data files while open"
    store.close()
    assert not mappings(tmp_path / "d"), mappings(tmp_path / "d")
    assert store.stats().disk_tokens > 0           # the closed store's bookkeeping is still readable


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs of the given size (root only; the test is skipped where mounting is impossible)."""
    mounted = []

    def mount(name, size, ro=False):
        where = tmp_path / name
        where.mkdir()
        opts = f"size={size}" + (",ro" if ro else "")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:     # closed stores no longer map their files (test_close_unmaps_the_data_files)
        subprocess.run(["umount", str(where)], check=True)


def test_full_filesystem_then_space_comes_back(tmp_path, tmpfs):
    model, oracle = models()
    mnt = tmpfs("mnt", "2m")
    store = open_store(model, mnt / "d", 192)
    convs = conversations(3)
    play(store, convs, oracle)
    filler = mnt / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:                                        # until ENOSPC
            f.write(b"\0" * 65536)
            f.flush()
    assert shutil.disk_usage(mnt).free < 65536
    for _ in range(4):
        for sid in convs:
            with contextlib.suppress(StoreError):
                store.move(sid, stored(store, sid), "disk")
            store.check_integrity()
        play(store, convs, oracle)
    failures = store.stats().disk_write_failures
    filler.unlink()
    for sid in convs:
        with contextlib.suppress(stateful_hf.CapacityError):
            store.move(sid, stored(store, sid), "disk")
    assert not store.stats().disk_degraded
    play(store, convs, oracle)
    store.move("s0", stored(store, "s0"), "disk")
    store.close()
    again = open_store(model, mnt / "d", 192)
    play(again, convs, oracle)
    again.close()
    print(f"commits/flushes that failed on the full filesystem: {failures}")


# ---- 4. damaged files between runs ------------------------------------------------------------------

def _index(d, sql, *args):
    with sqlite3.connect(d / "index.sqlite") as db:
        db.execute(sql, args)


def _rows(d):
    with sqlite3.connect(d / "index.sqlite") as db:
        return db.execute("SELECT session, k, slot, checksum FROM chunks WHERE form = 'kv' ORDER BY slot").fetchall()


def _damage(kind, d, spec):
    path = kv_file(d)
    per_layer = path.stat().st_size // spec.num_layers
    rows = _rows(d)
    if kind == "truncate":                                 # the second layer of the upper slots is gone
        os.truncate(path, per_layer + per_layer // 2)
        return None
    if kind == "delete":
        path.unlink()
        return len(rows)
    if kind == "scribble":                                 # noise in one slot (layer 1, its V)
        slot = rows[1][2]
        with open(path, "r+b") as f:
            f.seek(per_layer + slot * spec.bytes_per_block // spec.num_layers + 100)
            f.write(os.urandom(64))
        return 1
    (a, ka, sa, ca), (b, kb, sb, cb) = rows[0], rows[-1]
    if kind == "swap-slots":                               # two slot numbers exchanged
        _index(d, "UPDATE chunks SET slot = ? WHERE session = ? AND k = ?", sb, a, ka)
        _index(d, "UPDATE chunks SET slot = ? WHERE session = ? AND k = ?", sa, b, kb)
        return 2
    if kind == "swap-rows":                                # slots and checksums exchanged: identity differs
        _index(d, "UPDATE chunks SET slot = ?, checksum = ? WHERE session = ? AND k = ?", sb, cb, a, ka)
        _index(d, "UPDATE chunks SET slot = ?, checksum = ? WHERE session = ? AND k = ?", sa, ca, b, kb)
        return 2
    if kind == "bad-rows":                                 # rows that cannot be right: left out, recomputed
        _index(d, "UPDATE chunks SET slot = 'x' WHERE session = ? AND k = ?", a, ka)
        _index(d, "UPDATE chunks SET k = 999 WHERE session = ? AND k = ?", b, kb)
        _index(d, "UPDATE chunks SET slot = ? WHERE session = ? AND k = ?", rows[1][2], *rows[2][:2])
        return {0, 1}             # the slot named twice: its first claimant is proven or fails, the other is left out
    if kind == "slot-count":                               # the header's block count edited
        _index(d, "UPDATE meta SET value = '32' WHERE key = 'kv.slots'")
        return None
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncate", "delete", "scribble", "swap-slots", "swap-rows", "slot-count",
                                  "bad-rows"])
def test_damaged_data_or_index_is_recomputed(kind, tmp_path):
    model, oracle = models()
    d = tmp_path / "d"
    store = open_store(model, d, 256)
    convs = conversations(2)
    play(store, convs, oracle)
    all_to_disk(store, convs)
    total = store.stats().disk_tokens
    store.close()
    expect = _damage(kind, d, store.spec)
    again = open_store(model, d, 256)
    again.check_integrity()
    before = {sid: again.residency(sid) for sid in convs}
    turns = play(again, convs, oracle)
    failed = again.stats().disk_checksum_failures
    assert failed in expect if isinstance(expect, set) else failed == expect if expect is not None else failed > 0
    lost = sum(t.recomputed_tokens for t in turns.values())
    assert sum(t.swapped_in_disk for t in turns.values()) == total - lost
    assert lost == sum(b["dropped"] for b in before.values()) + again.stats().counters.dropped > 0
    again.close()


def test_damaged_hidden_file_is_recomputed(tmp_path):
    model, oracle = models("opt")
    d = tmp_path / "d"
    kw = {"hidden_states": "always", "hidden_layers": 1, "host_capacity": 256}
    store = open_store(model, d, 256, **kw)
    convs = conversations(2)
    play(store, convs, oracle)
    for sid in convs:
        ks = range(len(store.session(sid).chunks))
        store.move(sid, ks, "hidden")
        store.move(sid, ks, "disk")
    assert store.stats().disk_hidden_tokens == store.stats().disk_tokens > 0
    store.close()
    (hidden,) = d.glob("hidden.*.bin")
    with open(hidden, "r+b") as f:                         # noise in slot 0's hidden states
        f.seek(8)
        f.write(os.urandom(32))
    os.truncate(hidden, hidden.stat().st_size - 4096)      # and the last page gone
    again = open_store(model, d, 256, **kw)
    turns = play(again, convs, oracle)
    assert again.stats().disk_checksum_failures >= 1
    assert sum(t.recomputed_tokens for t in turns.values()) > 0
    again.close()


def test_cut_inside_a_disk_chunk_keeps_it(tmp_path):
    model, oracle = models()
    store = open_store(model, tmp_path / "d", 256)
    conv = Conversation(seed=3, first=70)
    play(store, {"a": conv}, oracle)
    all_to_disk(store, ["a"])
    edited = conv.ids[:, :40]                              # an edit inside chunk 2 (tokens 32..47)
    store.truncate("a", 40)
    store.check_integrity()
    out = greedy(model, edited, n=6, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, edited, n=6))
    assert store.stats("a").last_turn.swapped_in_disk == 39 and store.stats().disk_checksum_failures == 0
    store.close()


# ---- 5. creation, refusal, bad directories -------------------------------------------------------

def test_another_model_or_damaged_header_is_refused_and_left_alone(tmp_path):
    model, oracle = models()
    d = tmp_path / "d"
    store = open_store(model, d, 128)
    play(store, conversations(1), oracle)
    all_to_disk(store, ["s0"])
    store.close()
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.name != "lock"}
    finetuned = FAMILIES["llama"]()
    with torch.no_grad():
        finetuned.model.layers[1].mlp.down_proj.weight.mul_(1.01)   # same geometry, other weights
    with pytest.raises(StoreError, match="another model") as e:
        open_store(finetuned, d, 128)
    assert str(d) in str(e.value)
    with pytest.raises(StoreError, match="another geometry"):
        open_store(FAMILIES["opt"](), d, 128)
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.name != "lock"} == before   # never overwritten
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    _index(bad, "UPDATE meta SET value = 'not json' WHERE key = 'geometry'")
    with pytest.raises(StoreError, match="damaged"):
        open_store(model, bad, 128)
    (bad / "index.sqlite").write_bytes(b"garbage" * 100)
    for p in bad.glob("index.sqlite-*"):
        p.unlink()
    with pytest.raises(StoreError, match="unreadable|cannot be opened"):
        open_store(model, bad, 128)
    old = tmp_path / "old"
    old.mkdir()
    (old / "index.json").write_text("{}")
    with pytest.raises(StoreError, match="older format"):
        open_store(model, old, 128)
    assert sorted(p.name for p in old.iterdir()) == ["index.json"]


def test_creation_failures_leave_nothing_behind(tmp_path, monkeypatch):
    model, _ = models()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for where in (blocker, blocker / "d"):
        with pytest.raises(StoreError, match="not writable"):
            open_store(model, where, 128)
    assert blocker.read_text() == "not a directory"
    with pytest.raises(StoreError, match="free"):          # larger than the filesystem: checked first
        open_store(model, tmp_path / "a" / "big", "64PB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    real_fallocate = os.posix_fallocate

    def enospc(fd, offset, length):                        # the space went between the check and the allocation
        real_fallocate(fd, 0, 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", enospc)
    with pytest.raises(StoreError, match="No space left"):
        open_store(model, tmp_path / "b", 128)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_read_only_filesystem_is_a_clear_error(tmp_path, tmpfs):
    model, _ = models()
    ro = tmpfs("ro", "1m", ro=True)
    with pytest.raises(StoreError, match="not writable"):
        open_store(model, ro / "d", 128)
    with pytest.raises(StoreError, match="not writable"):
        open_store(model, ro, 128)
    assert list(ro.iterdir()) == []


# ---- 3. crashes: at every durability point, and at random times (fresh interpreters) ---------------

POINTS = {"data-flush", "index-commit", "relocate-copied", "relocate-committed"}


def test_crash_at_the_durability_points(tmp_path):
    """The scripted worker (benchmarks/disk_faults.py `scripted`, fresh interpreters) killed at its
    durability points around slot reuses and a relocation; its points are: creation 1-5, s0 to disk
    6-7, s1 to disk 8 (commit freeing s0's pushed-out slots) 9 (flush of s1 written into them) 10,
    close 11, relocation 12-15, turns and moves 16-21 (a reopened index that equals the loaded state
    is not committed again, nor a commit that changes nothing). `python -m benchmarks.disk_faults
    points` kills it at every one. Each reopened directory serves every saved session exactly."""
    from benchmarks.disk_faults import crash_sweep

    model, _ = models()
    results = crash_sweep(model, (8, 9, 11, 12, 13, 14, 15), tmp_path)
    assert {name for _, name, _, _ in results} == POINTS, results
    assert sum(turns for _, _, turns, _ in results) > 0
    assert all(wrong == 0 for _, _, _, wrong in results), results


def test_random_kills_never_give_a_wrong_turn():
    from benchmarks.disk_faults import kill_loop

    totals = kill_loop(seconds=10, seed=3, log=lambda line: None)
    assert totals["kills"] >= 1 and totals["checked_turns"] > 0, totals
    assert totals["worker_wrong"] == 0 and totals["checked_wrong"] == 0, totals


@pytest.mark.parametrize("capacity", [512, 48])
def test_hidden_file_capacity_change_relocates(capacity, tmp_path):
    model, oracle = models("opt")
    d = tmp_path / "d"
    kw = {"hidden_states": "always", "hidden_layers": 1, "host_capacity": 256}
    store = open_store(model, d, 256, hidden_disk_capacity=256, **kw)
    conv = Conversation(seed=9, first=60)
    play(store, {"a": conv}, oracle)
    ks = range(len(store.session("a").chunks))             # 5 chunks
    store.move("a", ks, "hidden")
    store.move("a", ks, "disk")
    store.close()
    again = open_store(model, d, 256, hidden_disk_capacity=capacity, **kw)   # grown, or shrunk to 3 slots
    assert again.tiers.disk_hidden.num_blocks == capacity // 16 and len(list(d.glob("hidden.*.bin"))) == 1
    kept = [k for k, c in enumerate(again.session("a").chunks) if c.state.value == "disk_hidden"]
    assert kept == (list(ks) if capacity == 512 else list(ks)[-3:])
    before = again.residency("a")
    turns = play(again, {"a": conv}, oracle)
    assert turns["a"].restored_hidden == before["disk_hidden"] and turns["a"].recomputed_tokens == before["dropped"]
    assert again.stats().disk_checksum_failures == 0
    again.close()


def test_a_bulk_import_to_disk_is_committed_whole_and_a_bad_export_keeps_the_ones_before(tmp_path):
    """`import_sessions` puts copies of one exported conversation straight on disk with one index commit;
    a restarted store finds every copy and continues each exactly. An export of another geometry part
    way raises (naming it) and the copies imported before it are committed all the same, the ones
    after it not imported; check_integrity holds throughout."""
    import copy
    import dataclasses

    model, oracle = models()
    store = open_store(model, str(tmp_path))
    conv = conversations(1)["s0"]
    play(store, {"c0": conv}, oracle)
    exp = store.export_session("c0")
    bad = dataclasses.replace(exp, session_id="bad", geometry=(9, 9, 9))
    copies = [dataclasses.replace(exp, session_id=f"k{i}") for i in range(4)]
    assert store.import_sessions(copies[:2], "disk") == 2 * exp.kv_tokens
    with pytest.raises(ValueError, match="'bad'"):
        store.import_sessions([copies[2], bad, copies[3]], "disk")
    store.check_integrity()
    assert {f"k{i}" for i in range(3)} <= set(store.session_ids()) and "k3" not in store.session_ids()
    store.close()
    store = open_store(model, str(tmp_path))
    for i in range(3):
        assert stored(store, f"k{i}") and {p.value for p in store.places(f"k{i}")} == {"lower"}, i
    convs = {f"k{i}": copy.deepcopy(conv) for i in range(3)}
    turns = play(store, convs, oracle)
    assert all(t.reused_tokens >= exp.kv_tokens and not t.recomputed_tokens for t in turns.values()), turns
    store.close()


def test_a_bulk_import_writes_straight_into_host_or_disk_and_a_failed_flush_makes_none(tmp_path, monkeypatch):
    """`import_sessions(..., "host" / "disk")` writes each exported chunk into a slot of that tier (no
    device step: the device stays empty) and leaves the chunks that were not exported dropped; every
    copy then continues exactly. A batch larger than the tier goes in one session at a time, later
    copies pushing earlier ones down. A data flush that fails during a disk import raises StoreError
    and makes none of its sessions (the room made for them stays made: other chunks dropped, to be
    recomputed); while the tier stays degraded an import is refused before anything changes, as a move
    to disk is; integrity holds throughout and the tier recovers."""
    import copy
    import dataclasses

    model, oracle = models()
    store = open_store(model, str(tmp_path / "d"), 512, host_capacity=512)
    conv = conversations(1, first=70)["s0"]
    play(store, {"c0": conv}, oracle)
    store.move("c0", [1], "dropped")
    exp = store.export_session("c0")
    assert exp.chunks == [0, 2, 3, 4]                      # chunks of 16 tokens: 76 tokens
    store.delete("c0")
    for tier, place in (("host", "host"), ("disk", "disk")):
        copies = [dataclasses.replace(exp, session_id=f"{tier}{i}") for i in range(3)]
        before = store.stats().counters
        assert store.import_sessions(copies, tier) == 3 * exp.kv_tokens
        store.check_integrity()
        after = store.stats().counters      # not imported to the device and moved down (that counts swaps out)
        assert store.stats().device_tokens == 0 and (after.swapped_out_host, after.swapped_out_disk) == (
            before.swapped_out_host, before.swapped_out_disk)
        for i in range(3):
            assert [c.state.value for c in store.session(f"{tier}{i}").chunks] == [place, "dropped"] + [place] * 3
    turns = play(store, {sid: copy.deepcopy(conv) for sid in store.session_ids()}, oracle)
    assert all(t.reused_tokens >= exp.kv_tokens for t in turns.values()), turns     # (the rest: shared or recomputed)
    # more than the disk tier holds (32 slots, 12 held): one at a time, later ones pushing earlier ones down
    many = [dataclasses.replace(exp, session_id=f"m{i}") for i in range(9)]
    assert store.import_sessions(many, "disk") == 9 * exp.kv_tokens
    store.check_integrity()
    assert [c.state.value for c in store.session("m8").chunks] == ["disk", "dropped"] + ["disk"] * 3
    held = set(store.session_ids())
    faults = Faults(monkeypatch, "data-flush")
    with pytest.raises(StoreError, match="could not flush"):
        store.import_sessions([dataclasses.replace(exp, session_id=f"f{i}") for i in range(2)], "disk")
    assert faults.hits == 1 and set(store.session_ids()) == held   # (room made for it stays made)
    store.check_integrity()
    with pytest.raises(StoreError, match="degraded"):       # as a move to disk: retried first, refused whole
        store.import_sessions([dataclasses.replace(exp, session_id="f2")], "disk")
    assert faults.hits == 2 and set(store.session_ids()) == held
    store.check_integrity()
    faults.on = False
    store.import_sessions([dataclasses.replace(exp, session_id="f0")], "disk")
    play(store, {"f0": copy.deepcopy(conv)}, oracle)
    store.close()


# ---- reads ahead of a move up -------------------------------------------------------------------------------

def _merged(ranges):
    """Byte ranges [a, b) merged into disjoint sorted ones."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(r) for r in out]


def test_prefetch_asks_for_exactly_the_named_slots_bytes(tmp_path, monkeypatch):
    """`DiskFile.prefetch` advises WILLNEED over each run of consecutive slots, part by part, layer by layer:
    together exactly the slots' bytes, nothing of another slot's (`_madvise` rounds each start to its page)."""
    from stateful_hf.cache.disk import file as disk_file

    model, _ = models()
    store = open_store(model, tmp_path / "d", capacity=256)
    f = store.tiers.disk.files["kv"]
    calls = []
    monkeypatch.setattr(disk_file, "_madvise", lambda addr, length, advice: calls.append((addr, length, advice)))
    f.prefetch([3, 1, 2, 7])
    layers = sum(part.shape[0] for part in f._bytes)
    assert len(calls) == 2 * layers and {c[2] for c in calls} == {disk_file.MADV_WILLNEED}   # runs 1-3 and 7
    want = [(p.ctypes.data, p.ctypes.data + p.nbytes) for slot in (1, 2, 3, 7) for p in f.slot_pieces(slot)]
    assert _merged((a, a + n) for a, n, _ in calls) == _merged(want)
    other = [(p.ctypes.data, p.ctypes.data + p.nbytes) for p in f.slot_pieces(4)]
    assert not any(a < e and s < a + n for a, n, _ in calls for s, e in other)      # the control: slot 4 untouched
    store.close()


def test_a_move_up_from_disk_reads_its_slots_ahead_and_stays_exact(tmp_path, monkeypatch):
    """A returning session whose chunks are on disk, unproven (as after a restart): the verification and the
    move up read their slots ahead (every slot it holds, asked before any is checked or copied), and the turn
    is exact."""
    from stateful_hf.cache.disk.file import DiskFile

    model, oracle = models()
    store = open_store(model, tmp_path / "d", capacity=256)
    convs = conversations(1)
    play(store, convs, oracle)
    all_to_disk(store, list(convs))
    sums = store.tiers.disk.pool.checksums
    for slot in sums.slots():
        sums.set(slot, sums[slot])                   # known, not proven: the first read verifies
    held = {c.loc for c in store.session("s0").chunks if c.state.value == "disk"}
    assert held
    asked: list[set[int]] = []
    real = DiskFile.prefetch
    monkeypatch.setattr(DiskFile, "prefetch", lambda self, slots: (asked.append(set(slots)), real(self, slots)))
    play(store, convs, oracle)
    assert asked and asked[0] == held                # the first ask: every slot the verification reads
    store.close()
