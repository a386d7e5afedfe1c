"""Prefix sharing on the disk tier (issue 23): a chunk shared by sessions moves to disk once, stays
shared there (one slot, a row of each holder in the disk index), comes up once for all, and a
restart rebuilds the sharing and the prefix index, so a new session adopts a saved prefix from disk.
Every turn is checked against stateless greedy generate on the whole conversation, and the store's
integrity (slots, holders, the disk index's rows) after every step."""

from __future__ import annotations

import os
import sqlite3
from functools import partial

import pytest
import torch
from conftest import FAMILIES, engine_round_ids, greedy, store_turn

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CostProfile, FairSharePolicy
from stateful_hf.engine.request import RequestFailed

BS = 8
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(7))   # 5 full chunks + 3
SHARED = 5 * BS


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(1000 + seed))


turn = partial(store_turn, n=6)     # one exact turn of a session, integrity checked after it


def open_store(model, d, **kw):
    opts = dict(device_capacity=1024, chunk_size=BS, disk_dir=d, disk_capacity=1024, cost_profile=CostProfile())
    return stateful_hf.SessionStore(model, **{**opts, **kw})


def all_chunks(store, sid):
    return range(len(store.session(sid).chunks))


def shared_objects(store, a, b, n=5):
    """Whether chunks 0..n-1 of sessions a and b are one object each."""
    return all(store.session(a).chunks[k] is store.session(b).chunks[k] for k in range(n))


def shared_on_disk(model, oracle, store) -> dict[str, torch.Tensor]:
    """Sessions a and b open with SYSTEM (exact turns), then move every chunk to disk; their conversations."""
    convs = {sid: turn(model, oracle, store, sid, torch.cat([SYSTEM, user(i)], 1)) for i, sid in enumerate("ab")}
    for sid in convs:
        store.move(sid, all_chunks(store, sid), "disk")
    return convs


def disk_rows(d):
    with sqlite3.connect(d / "index.sqlite") as db:
        return db.execute("SELECT session, k, form, slot, checksum FROM chunks ORDER BY slot, session").fetchall()


@pytest.fixture
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def test_a_shared_prompt_moves_to_disk_once_and_comes_back_once(models, tmp_path):
    model, oracle = models
    store = open_store(model, tmp_path / "d")
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    b = turn(model, oracle, store, "b", torch.cat([SYSTEM, user(2)], 1))
    store.move("a", all_chunks(store, "a"), "disk")      # the shared chunks go for b too: one copy
    store.check_integrity()
    assert store.residency("b")["disk"] == SHARED and store.residency("b")["dropped"] == 0
    st = store.stats()
    assert st.disk_tokens == store.session("a").num_tokens            # the shared chunks once
    assert store.tiers.disk.pool.num_blocks - store.tiers.disk.pool.num_free == len(store.session("a").chunks)
    assert shared_objects(store, "a", "b") and st.shared_tokens == SHARED and st.prefix_index_chunks >= 5
    rows = disk_rows(tmp_path / "d")                      # committed: a row of each holder, one slot
    shared = [r for r in rows if r[1] < 5]
    assert len(shared) == 10 and len({(r[3], r[1], r[4]) for r in shared}) == 5
    b = turn(model, oracle, store, "b", torch.cat([b, user(3)], 1))
    last = store.stats("b").last_turn
    assert last.swapped_in_disk == SHARED and last.recomputed_tokens == 0    # up once, in place for a too
    assert store.residency("a")["device"] == SHARED
    private = store.residency("a")["disk"]
    assert private == store.session("a").num_tokens - SHARED
    a = turn(model, oracle, store, "a", torch.cat([a, user(4)], 1))
    last = store.stats("a").last_turn
    assert (last.reused_device, last.swapped_in_disk, last.recomputed_tokens) == (SHARED, private, 0)
    turn(model, oracle, store, "c", torch.cat([SYSTEM, user(5)], 1))
    assert store.stats("c").last_turn.reused_tokens == SHARED
    assert store.stats().disk_checksum_failures == 0
    store.close()


@pytest.mark.parametrize("capacity", [1024, 8 * BS])
def test_restart_rebuilds_sharing_and_a_new_session_adopts_from_disk(models, tmp_path, capacity):
    """Sessions sharing a prompt, all on disk, store closed; a new store on the directory holds the
    shared chunks once again, indexed: a new session takes them from disk, the old ones continue.
    With a smaller disk (8 slots for 11: relocation copies each shared slot once, the lowest chunks
    go) chunks 3-4 stay shared but unfindable (their parents are gone) and 0-2 are recomputed."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    convs = shared_on_disk(model, oracle, store)
    on_disk = store.stats().disk_tokens
    assert on_disk == 2 * store.session("a").num_tokens - SHARED
    store.close()

    # disk_write="evict": copies written behind would be checksummed too, and this test counts the proofs
    store = open_store(model, d, disk_capacity=capacity, disk_write="evict")
    store.check_integrity()
    st = store.stats()
    full = capacity == 1024
    assert all(store.session("a").chunks[k] is store.session("b").chunks[k] for k in range(0 if full else 3, 5))
    assert st.shared_tokens == (SHARED if full else 2 * BS) and st.prefix_index_chunks == (9 if full else 0)
    assert st.disk_tokens == (on_disk if full else on_disk - 3 * BS)
    assert store.tiers.disk.pool.num_blocks - store.tiers.disk.pool.num_free == (11 if full else 8)
    kv_file, proofs = store.tiers.disk.files["kv"], []
    checksum = kv_file.checksum
    kv_file.checksum = lambda tag, slot: proofs.append(slot) or checksum(tag, slot)     # count the proofs
    c = turn(model, oracle, store, "c", torch.cat([SYSTEM, user(5)], 1))
    last = store.stats("c").last_turn
    assert last.reused_tokens == last.swapped_in_disk == (SHARED if full else 0) and last.recomputed_tokens == 0
    assert last.computed_tokens == SYSTEM.shape[1] + 9 - last.reused_tokens + 5   # prompt rows, 5 decode rows
    for sid in convs:                # shrunk: their dropped chunks 0-2 come back from c, which computed them
        assert store.residency(sid)["dropped"] == (0 if full else 3 * BS)
        convs[sid] = turn(model, oracle, store, sid, torch.cat([convs[sid], user(6)], 1))
        last = store.stats(sid).last_turn
        assert last.recomputed_tokens == 0 and last.reused_tokens == store.session(sid).num_tokens - 15
    turn(model, oracle, store, "c", torch.cat([c, user(7)], 1))
    assert store.stats().disk_checksum_failures == 0
    assert sorted(proofs) == sorted(set(proofs)) and len(proofs) == (11 if full else 8)   # each slot proven once
    store.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_restart_brings_the_shared_prefix_up_before_the_first_turn(models, tmp_path, prefetch):
    """After a restart every chunk is on disk; `prefetch_shared` (a server's replica calls it before /health)
    brings the chunks both sessions share up to the device, proven as read, once: the first returning turn then
    reads only its own chunks from disk, exact. Control (no prefetch): that turn reads the shared ones too."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    convs = shared_on_disk(model, oracle, store)
    store.close()

    store = open_store(model, d, disk_write="evict")
    a = store.session("a")
    assert all(a.chunks[k].state.value == "disk" for k in range(5))
    if prefetch:
        assert store.prefetch_shared(fraction=1.0) == SHARED
        store.check_integrity()
        assert all(a.chunks[k].state.value == "device" and a.chunks[k] is store.session("b").chunks[k]
                   for k in range(5))
        assert store.prefetch_shared() == 0                   # nothing shared is left below the device
    own = store.session("a").num_tokens - SHARED
    turn(model, oracle, store, "a", torch.cat([convs["a"], user(5)], 1))
    last = store.stats("a").last_turn
    assert last.recomputed_tokens == 0 and last.swapped_in_disk == (own if prefetch else own + SHARED)
    assert store.stats().disk_checksum_failures == 0
    store.close()


def test_restart_keeps_the_scope_of_what_it_shares(models, tmp_path):
    """A prefix saved under a cache_salt is adopted after a restart by a new session with that salt
    only; a saved session continues under its salt, and another salt is refused for it."""
    model, oracle = models
    d = tmp_path / "d"
    ids = torch.cat([SYSTEM, user(1)], 1)[0].tolist()
    want = greedy(oracle, torch.tensor([ids]), n=6)[0, len(ids):].tolist()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def reused(engine, sid, salt=None):
        out = engine.submit(sid, ids, params, cache_salt=salt).result()
        assert list(out.token_ids) == want
        engine.store.check_integrity()
        return out.metrics.reused_tokens

    store = open_store(model, d)
    engine = Engine(model, store=store)
    assert reused(engine, "x", "s") == 0
    assert reused(engine, "y", "s") == 48             # all 6 full chunks of x's prompt
    for sid in ("x", "y"):
        store.move(sid, all_chunks(store, sid), "disk")
    store.close()

    store = open_store(model, d)
    store.check_integrity()
    engine = Engine(model, store=store)
    assert shared_objects(store, "x", "y", 6)
    assert reused(engine, "p") == 0                    # no salt: another scope
    assert reused(engine, "q", "t") == 0               # another salt
    assert reused(engine, "r", "s") == 48              # the saved prefix, from disk
    more = ids + want + user(8)[0].tolist()
    with pytest.raises(RequestFailed, match="opened with cache_salt 's'"):
        engine.submit("x", more, params).result()
    out = engine.submit("x", more, params, cache_salt="s").result()       # its own salt: it continues
    assert list(out.token_ids) == greedy(oracle, torch.tensor([more]), n=6)[0, len(more):].tolist()
    assert out.metrics.reused_tokens == len(ids) + len(want) - 1
    store.check_integrity()
    store.close()


def test_retained_prefix_survives_a_restart(models, tmp_path):
    """A throwaway request's prompt kept as a retained prefix (delete with keep_shared), moved to
    disk: after a restart it is still a retained prefix (not a listed session) that a new session
    adopts."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    turn(model, oracle, store, "t", torch.cat([SYSTEM, user(1)], 1))
    store.delete("t", keep_shared=True)
    assert "t" not in store.session_ids()
    store.move("t", all_chunks(store, "t"), "disk")
    store.close()
    store = open_store(model, d)
    store.check_integrity()
    assert "t" not in store.session_ids() and store.stats().prefix_index_chunks == 7   # its full chunks
    turn(model, oracle, store, "u", torch.cat([SYSTEM, user(2)], 1))
    assert store.stats("u").last_turn.swapped_in_disk == SHARED
    store.close()


def kv_file(d):
    (path,) = d.glob("kv.*.bin")
    return path


def test_a_damaged_shared_slot_is_recomputed_by_every_holder(models, tmp_path):
    """Bytes of a shared chunk's slot flipped between runs: the new session that adopts it, and each
    old holder, finds it bad when it reads it and recomputes it; none is served it."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    convs = shared_on_disk(model, oracle, store)
    spec = store.spec
    store.close()
    (slot,) = {r[3] for r in disk_rows(d) if r[1] == 2}          # chunk 2: one slot, two rows
    path = kv_file(d)
    per_layer = path.stat().st_size // spec.num_layers
    with open(path, "r+b") as f:                                # its K in layer 0
        f.seek(slot * spec.bytes_per_block // spec.num_layers + 40)
        data = f.read(16)
        f.seek(-16, os.SEEK_CUR)
        f.write(bytes(x ^ 0x5A for x in data))
    assert per_layer > 0
    store = open_store(model, d)
    store.check_integrity()
    turn(model, oracle, store, "c", torch.cat([SYSTEM, user(5)], 1))
    last = store.stats("c").last_turn
    assert (last.recomputed_tokens, last.swapped_in_disk) == (BS, SHARED - BS)
    assert store.stats().disk_checksum_failures == 1
    for n, sid in enumerate(convs, start=2):
        convs[sid] = turn(model, oracle, store, sid, torch.cat([convs[sid], user(6)], 1))
        assert store.stats(sid).last_turn.recomputed_tokens == BS
        assert store.stats().disk_checksum_failures == n
    store.close()


def test_the_policy_moves_shared_chunks_to_disk_under_pressure(models, tmp_path):
    """A small device and host: other sessions' long turns push the idle sharers' chunks down to the
    host, then to the disk, the shared ones once; they come back exactly."""
    model, oracle = models
    store = open_store(model, tmp_path / "d", device_capacity=12 * BS, host_capacity=10 * BS, policy="lru")
    convs = {sid: turn(model, oracle, store, sid, torch.cat([SYSTEM, user(i)], 1)) for i, sid in enumerate("ab")}
    for i, sid in enumerate("xy"):
        turn(model, oracle, store, sid, user(50 + i, 70))
    a, b = store.session("a"), store.session("b")
    assert all(a.chunks[k] is b.chunks[k] and a.chunks[k].state.value == "disk" for k in range(5))
    assert store.moves.snapshot()[("host", "disk", "pressure")].chunks > 0
    physical = {id(c): s.chunk_len(k, BS) for s in (a, b, store.session("x"), store.session("y"))
                for k, c in enumerate(s.chunks) if c.state.value == "disk"}
    assert store.stats().disk_tokens == sum(physical.values()) == sum(
        store.residency(sid)["disk"] for sid in "abxy") - SHARED
    for i, sid in enumerate(convs):
        convs[sid] = turn(model, oracle, store, sid, torch.cat([convs[sid], user(10 + i)], 1))
        last = store.stats(sid).last_turn
        assert last.recomputed_tokens == 0 and last.swapped_in_disk == (57 if sid == "a" else 57 - SHARED)
    store.close()


def test_engine_with_a_disk_under_pressure_and_a_shared_prompt(models, tmp_path):
    """Sessions sharing a system prompt and others with long unrelated prompts take turns in groups
    through the engine, on a device and host that hold few of them, a disk behind: the policy moves
    the shared chunks (idle between their group's turns) to disk, once, and back; every answer
    stays exact."""
    model, oracle = models
    store = open_store(model, tmp_path / "d", device_capacity=24 * BS, host_capacity=8 * BS)
    engine = Engine(model, store=store, max_batch_tokens=64)
    convs = {f"s{i}": torch.cat([SYSTEM, user(i)], 1) for i in range(4)}
    convs.update({f"x{i}": user(20 + i, 60) for i in range(3)})
    seen = set()         # shared chunks seen on disk (at any move: earlier batches have landed)

    def look(batch):
        seen.update(id(c) for s in store.sessions for c in s.chunks
                    if c.entry is not None and len(c.entry.holders) > 1 and c.state.value == "disk")

    store.moves.subscribe(look)
    for rnd, group in enumerate("sxsxs"):
        group_sids = [sid for sid in convs if sid[0] == group]
        engine_round_ids(engine, oracle, convs, group_sids, 4, lambda sid, rnd=rnd: user(10 * rnd + int(sid[1:])))
        store.check_integrity()
    assert store.stats().counters.swapped_out_disk > 0 and store.stats().counters.swapped_in_disk > 0 and seen
    store.close()


def test_shared_hidden_states_on_disk_survive_a_restart(tmp_path):
    """A shared chunk kept as hidden states goes to the disk's hidden file once (DISK_HIDDEN); after
    a restart it is one chunk again, and a new session rebuilds it from there, exactly."""
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    d = tmp_path / "d"
    kw = dict(host_capacity=1024, hidden_states="always", hidden_layers=1)
    store = open_store(model, d, **kw)
    convs = {sid: turn(model, oracle, store, sid, torch.cat([SYSTEM, user(i)], 1)) for i, sid in enumerate("ab")}
    store.move("a", range(5), "hidden")
    store.move("a", range(5), "disk")
    assert store.residency("b")["disk_hidden"] == SHARED and store.stats().disk_hidden_tokens == SHARED
    store.close()
    store = open_store(model, d, **kw)
    store.check_integrity()
    assert shared_objects(store, "a", "b") and store.session("a").chunks[0].state.value == "disk_hidden"
    turn(model, oracle, store, "c", torch.cat([SYSTEM, user(5)], 1))
    last = store.stats("c").last_turn
    assert last.restored_hidden == SHARED and last.recomputed_tokens == 0
    for i, sid in enumerate(convs):
        turn(model, oracle, store, sid, torch.cat([convs[sid], user(6 + i)], 1))
        assert store.stats(sid).last_turn.recomputed_tokens == 0
    store.close()


def test_a_format_2_directory_is_upgraded_in_place(models, tmp_path):
    """A tier written before the sessions' scope was recorded (format 2): it opens, upgraded in one
    transaction; its sessions continue exactly; their chunks are not indexed until a turn registers
    them (their scope was not recorded)."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    a = turn(model, oracle, store, "a", torch.cat([SYSTEM, user(1)], 1))
    store.move("a", all_chunks(store, "a"), "disk")
    store.close()
    with sqlite3.connect(d / "index.sqlite") as db:            # as format 2 wrote it
        for column in ("tenant", "cache_salt", "retained"):
            db.execute(f"ALTER TABLE sessions DROP COLUMN {column}")
        db.execute("UPDATE meta SET value = 'stateful-hf disk tier 2' WHERE key = 'format'")
    store = open_store(model, d)
    store.check_integrity()
    assert store.stats().prefix_index_chunks == 0 and store.residency("a")["disk"] == store.session("a").num_tokens
    with sqlite3.connect(d / "index.sqlite") as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone() == ("stateful-hf disk tier 3",)
    turn(model, oracle, store, "a", torch.cat([a, user(2)], 1))
    assert store.stats("a").last_turn.recomputed_tokens == 0
    turn(model, oracle, store, "c", torch.cat([SYSTEM, user(3)], 1))
    assert store.stats("c").last_turn.reused_tokens == SHARED        # registered again by a's turn
    store.close()


def test_crash_at_the_durability_points_with_shared_chunks(tmp_path):
    """The shared scripted worker (benchmarks/disk_faults.py `scripted_shared`, fresh interpreters)
    killed at durability points around shared chunks: s1 to disk reusing s0's freed slot (8-9; the shared
    chunks it brought up kept their slots as copies: no write), s2 adopting the prefix from disk (10) and
    to disk (12-13), the commit after s0 let go of the shared slots (14), the relocation copying each shared
    slot once (16, 18). `python -m benchmarks.disk_faults points
    --script shared` kills it at every one. Each reopened directory serves every saved session,
    and a new session opening with the shared prompt, exactly (check_dir, integrity included)."""
    from benchmarks.disk_faults import crash_sweep, finish_worker, start_worker
    from stateful_hf.testing import tiny_llama

    whole = start_worker(tmp_path / "whole", script="shared")        # the whole run, beside the sweep's
    points = (8, 9, 10, 12, 13, 14, 16, 18)
    results = crash_sweep(tiny_llama(seed=0), points, tmp_path, script="shared")
    code, lines = finish_worker(whole)
    assert code == 0 and lines[-1] == "done" and not any("WRONG" in line for line in lines)
    assert max(int(line.split()[-1]) for line in lines if line.startswith("shared on disk")) == 3
    names = [line.split()[2] for line in lines if line.startswith("point")]
    assert len(names) == 24, names          # the points named in the docstring
    assert {name for _, name, _, _ in results} == {names[n - 1] for n in points} == {
        "data-flush", "index-commit", "relocate-copied", "relocate-committed"}, results
    assert all(turns > 1 for _, _, turns, _ in results) and all(wrong == 0 for *_, wrong in results), results


@pytest.mark.parametrize("kind", ["checksum", "scope", "virtual"])
def test_rows_that_cannot_be_one_chunk_keep_the_first_claimant(models, tmp_path, kind):
    """Rows of two sessions naming one slot become one chunk only when they can be one: with another
    checksum (chunk 2 of b), no recorded scope (b's), or a store that cannot share (a
    virtual layout), the first claimant keeps the slot and the other session's row is left out: it
    recomputes the chunk, or, sharing in the claimant's scope, adopts the claimant's indexed chunk."""
    model, oracle = models
    d = tmp_path / "d"
    store = open_store(model, d)
    convs = shared_on_disk(model, oracle, store)
    store.close()
    with sqlite3.connect(d / "index.sqlite") as db:
        if kind == "checksum":
            db.execute("UPDATE chunks SET checksum = checksum + 1 WHERE session = 'b' AND k = 2")
        elif kind == "scope":
            db.execute("UPDATE sessions SET tenant = NULL WHERE id = 'b'")
    kw = {"layout": "virtual", "max_context": 256} if kind == "virtual" else {}
    store = open_store(model, d, **kw)
    store.check_integrity()
    a, b = store.session("a"), store.session("b")
    apart = [2] if kind == "checksum" else range(5)
    assert all(a.chunks[k] is not b.chunks[k] for k in apart)
    assert all(a.chunks[k] is b.chunks[k] for k in range(5) if k not in apart)
    dropped = {sid: store.residency(sid)["dropped"] for sid in convs}
    assert sorted(dropped.values()) == [0, len(apart) * BS]
    for i, sid in enumerate(sorted(convs, key=lambda sid: -dropped[sid])):    # the one that lost them first
        turn(model, oracle, store, sid, torch.cat([convs[sid], user(6 + i)], 1))
        last = store.stats(sid).last_turn
        if kind != "virtual":        # the same scope at its turn: its dropped chunks come back from the claimant's
            assert last.recomputed_tokens == 0 and last.reused_tokens == 57
        else:
            assert last.recomputed_tokens == dropped[sid]
    assert store.stats().disk_checksum_failures == 0
    store.close()


@pytest.mark.parametrize("fair", [False, True])
def test_a_chunk_read_up_from_disk_keeps_its_slot_as_its_copy(models, tmp_path, fair):
    """A returning session's disk chunks come up to the device and keep their slots as their disk copies
    (`DiskCopies.keep`): no holder's committed rows change (the commit after the turn computes the mover's rows
    only, not those of the other holder of its shared chunks, also under the fair share, whose per-tenant order
    lists every holder), evicting them back to disk writes only the chunk that grew, and a restart serves both
    sessions from disk, exactly."""
    model, oracle = models
    d = tmp_path / "d"

    def opened():
        store = open_store(model, d, write_behind_delay=3600)
        if fair:
            store.policy = FairSharePolicy(store.policy)
        return store

    store = opened()
    convs = shared_on_disk(model, oracle, store)
    with store.lock:
        assert store.disk_state.sync(force=True)
    before = set(disk_rows(d))
    full = store.session("a").num_tokens // BS                  # a's full chunks: their copies stay valid
    computed, commit = [], store.tiers.disk.commit            # the sessions whose rows each commit computed
    store.tiers.disk.commit = lambda sessions, rows: computed.extend(rows if sessions is None else sessions) or \
        commit(sessions, rows)
    convs["a"] = turn(model, oracle, store, "a", torch.cat([convs["a"], user(3)], 1))
    assert store.stats("a").last_turn.swapped_in_disk == store.session("a").num_tokens - 9 - 6
    with store.lock:
        assert store.disk_state.sync(force=True)
    assert set(computed) == {"a"}, computed           # b's rows: not even recomputed
    after = set(disk_rows(d))
    assert {r for r in after if r[0] == "b"} == {r for r in before if r[0] == "b"}
    assert {r for r in after if r[0] == "a"} == {r for r in before if r[0] == "a" and r[1] < full}
    assert all(store.disk_state.copies.of(store.session("a").chunks[k]) is not None for k in range(full))
    store.check_integrity()

    writes, written = [], store.disk_state.written
    store.disk_state.written = lambda items, target, slots: writes.extend(items) or written(items, target, slots)
    store.move("a", all_chunks(store, "a"), "disk")             # onto the copies: the grown chunks only are written
    assert sorted(k for _, k in writes) == list(range(full, len(store.session("a").chunks))), writes
    store.check_integrity()
    store.close(flush=False)

    store = opened()                   # every holder listed in a tier afresh: b in the device's once a's turn ran
    for i, sid in enumerate("ab"):
        held = store.session(sid).num_tokens
        convs[sid] = turn(model, oracle, store, sid, torch.cat([convs[sid], user(4 + i)], 1))
        last = store.stats(sid).last_turn
        assert last.reused_tokens == held and last.recomputed_tokens == 0, (sid, last)
    store.close()


def test_a_kept_copy_outlives_the_holder_it_was_recorded_for(models, tmp_path):
    """A shared chunk's disk copy is recorded for one holder (the one whose turn brought it up); when that holder
    goes (deleted, as a throwaway session is after its turn), the sweep records the copy for another holder
    instead of freeing it: the others keep their rows, and evicting the chunks again writes nothing."""
    model, oracle = models
    store = open_store(model, tmp_path / "d", write_behind_delay=3600)
    convs = shared_on_disk(model, oracle, store)
    turn(model, oracle, store, "a", torch.cat([convs["a"], user(3)], 1))   # the shared chunks come up for a
    shared = store.session("b").chunks[:5]
    assert [store.disk_state.copies.of(c).session_id for c in shared] == ["a"] * 5
    store.delete("a")
    with store.lock:
        store.disk_state.copies.sweep()
        assert store.disk_state.sync(force=True)
    assert [store.disk_state.copies.of(c).session_id for c in shared] == ["b"] * 5
    store.check_integrity()
    writes, written = [], store.disk_state.written
    store.disk_state.written = lambda items, target, slots: writes.extend(items) or written(items, target, slots)
    store.move("b", all_chunks(store, "b"), "disk")          # b's shared chunks were already there: onto the copies
    assert writes == [] and store.residency("b")["disk"] == store.session("b").num_tokens
    store.check_integrity()
    turn(model, oracle, store, "b", torch.cat([convs["b"], user(4)], 1))
    assert store.stats("b").last_turn.recomputed_tokens == 0
    store.close()
