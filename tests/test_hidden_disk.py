"""HCache on disk: hidden chunks moving below the host stay hidden states in the disk tier's hidden
file (DISK_HIDDEN). Every layout, alone and mixed with every other chunk state, across restarts and
under pressure, must give exactly the stateless tokens and keep every slot owned once."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy, seed_of

import stateful_hf
from stateful_hf.cache import CapacityError, ChunkState
from stateful_hf.cache.hidden.partition import HiddenCosts
from stateful_hf.testing import tiny_llama

PROFILE = stateful_hf.cache.CostProfile()
DH = ChunkState.DISK_HIDDEN


def disk_store(make_store, model, tmp_path, **kw):
    kw = {"device_capacity": 2048, "host_capacity": 2048, "disk_dir": tmp_path / "disk", "disk_capacity": 2048,
          "cost_profile": PROFILE, "hidden_states": "always", "hidden_layers": 1, **kw}
    return make_store(model, **kw)


def lay_out(store, sid, layout):
    """Put chunk k in state layout[k % len(layout)] ("disk_hidden": hidden states on disk) where the
    chunk's history allows it: hidden forms come from captured device chunks, dropped ones stay."""
    s = store.session(sid)
    want = {k: layout[k % len(layout)] for k in range(len(s.chunks))}
    st = {k: s.chunks[k].state for k in want}
    hidden_ok = {k for k in want if st[k] in (ChunkState.HIDDEN, DH) or
                 (st[k] is ChunkState.DEVICE and store.hidden.capture.valid[s.chunks[k].loc])}
    to_hidden = [k for k, t in want.items() if t in ("hidden", "disk_hidden") and k in hidden_ok]
    up = [k for k, t in want.items() if st[k] is not ChunkState.DROPPED and (
          t == "device" or (t in ("hidden", "disk_hidden") and k not in hidden_ok))]
    store.move(sid, up, "device")        # chunks that cannot be hidden yet become so after the next turn
    store.move(sid, to_hidden, "hidden")
    store.move(sid, [k for k in to_hidden if want[k] == "disk_hidden"], "disk")
    for tier in ("host", "disk", "dropped"):
        ks = [k for k, t in want.items() if t == tier and (tier == "dropped" or st[k] is not ChunkState.DROPPED)]
        store.move(sid, ks, tier)
    store.check_integrity()


LAYOUTS = [["disk_hidden"] * 9, ["disk_hidden", "device", "hidden", "host", "disk", "dropped"],
           ["dropped", "disk_hidden", "disk", "hidden", "disk_hidden", "host", "device"], ["hidden"] * 9,
           ["disk_hidden"] * 9, ["device", "disk_hidden"]]


@pytest.mark.parametrize("family,hidden_layers", [("llama", 1), ("mistral", 2), ("qwen2", 1), ("opt", 2),
                                                  ("opt-post-ln", 1)])
def test_disk_hidden_alone_and_mixed_is_exact(family, hidden_layers, make_store, tmp_path):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = disk_store(make_store, model, tmp_path, hidden_layers=hidden_layers)
    cache = store.cache("a")
    conv = Conversation(seed=seed_of(family + "disk"), first=70, turn=20)
    out = greedy(model, conv.ids, cache=cache)
    conv.reply(out)
    from_disk = 0
    for layout in LAYOUTS:
        lay_out(store, "a", layout)
        before = store.residency("a")
        from_disk += before["disk_hidden"]
        if layout[0] == "disk_hidden":
            assert before["disk_hidden"] > 0, (layout, before)
        out = greedy(model, conv.ids, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids)), layout
        turn = store.stats("a").last_turn
        assert turn.restored_hidden == before["hidden"] + before["disk_hidden"], (layout, before, turn)
        assert turn.recomputed_tokens == before["dropped"] and turn.swapped_in_disk == before["disk"]
        conv.reply(out)
    c = store.stats().counters
    assert c.restored_hidden_disk == from_disk > 0 and c.swapped_out_disk > 0


def test_disk_hidden_comes_back_to_the_host_and_steps_abort_cleanly(make_store, tmp_path):
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = disk_store(make_store, model, tmp_path)
    conv = Conversation(seed=5, first=90)
    conv.reply(greedy(model, conv.ids, cache=store.cache("a")))
    store.move("a", [0, 1, 2], "hidden")
    store.move("a", [0, 1, 2], "disk")
    assert [c.state for c in store.session("a").chunks[:3]] == [DH] * 3
    assert store.tiers.disk.drop_page_cache()            # cold reads from here on (benchmarks); data stays in the files
    store.move("a", [1], "hidden")                 # disk -> host, still hidden states
    assert store.session("a").chunks[1].state is ChunkState.HIDDEN
    n = store.session("a").num_tokens
    step = store.plan_step([("a", [5], [n])])      # rebuild in flight: sources still owned on disk
    assert store.session("a").chunks[0].source == (DH, store.session("a").chunks[0].source[1])
    store.check_integrity()
    with sqlite3.connect(tmp_path / "disk" / "index.sqlite") as index:
        named = index.execute("SELECT k FROM chunks WHERE session = 'a' AND form = 'hidden' ORDER BY k").fetchall()
    # a crash now loses nothing: 0 and 2 are named; 1 (moved up to the host) may still be, at its old slot, until
    # the writer commits the change that freed it (write-behind defers a change that only frees slots; the slot
    # is not rewritten before a commit forgets it)
    assert named in ([(0,), (2,)], [(0,), (1,), (2,)]), named
    store.abort(step)                              # no forward ran: back on disk, nothing lost
    assert [c.state for c in store.session("a").chunks[:3]] == [DH, ChunkState.HIDDEN, DH]
    store.check_integrity()
    out = greedy(model, conv.ids, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, conv.ids))
    assert store.stats().counters.restored_hidden_disk == 64


def test_pressure_moves_hidden_chunks_to_disk_then_drops_them(make_store, tmp_path):
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    # 5 chunks of host hidden states, 6 of disk hidden states; 6 sessions of 4 chunks each
    store = disk_store(make_store, model, tmp_path, device_capacity=512, hidden_capacity=160,
                       hidden_disk_capacity=192, disk_capacity=64, policy="lru")
    convs = {f"s{i}": Conversation(seed=40 + i, first=90) for i in range(6)}
    seen = set()
    for rnd in range(2):
        for sid in (convs if rnd == 0 else reversed(convs)):   # the latest first: their state is still stored
            conv = convs[sid]
            out = greedy(model, conv.ids, n=4, cache=store.cache(sid))
            assert torch.equal(out, greedy(oracle, conv.ids, n=4)), (rnd, sid)
            conv.reply(out)
            store.evict(sid)                       # device -> hidden; the host makes room -> disk -> dropped
            store.check_integrity()
            seen |= {c.state for s in store.session_ids() for c in store.session(s).chunks}
    st = store.stats()
    assert {ChunkState.HIDDEN, DH, ChunkState.DROPPED} <= seen
    assert st.disk_hidden_tokens > 0 and st.counters.swapped_out_disk > 0 and st.counters.dropped > 0
    assert st.counters.restored_hidden_disk > 0 and st.disk_tokens == st.disk_hidden_tokens
    assert "as hidden states" in store.summary().splitlines()[3]


def test_restart_sees_disk_hidden_chunks_and_continues_exactly(tmp_path):
    model, oracle = FAMILIES["qwen2"](), FAMILIES["qwen2"]()
    kw = dict(disk_dir=tmp_path / "d", disk_capacity=1024, host_capacity=512, cost_profile=PROFILE,
              hidden_states="always")
    store = stateful_hf.SessionStore(model, hidden_layers=1, **kw)
    conv = Conversation(seed=11, first=100)
    conv.reply(greedy(model, conv.ids, cache=store.cache("kept")))
    ks = range(len(store.session("kept").chunks))
    store.move("kept", ks, "hidden")
    store.move("kept", [k for k in ks if k % 2 == 0], "disk")   # hidden on disk
    store.move("kept", [k for k in ks if k % 2], "dropped")
    on_disk = store.stats("kept").disk_hidden_tokens
    assert on_disk > 0 and store.stats("kept").disk_tokens == on_disk
    store.close()
    # hidden_layers not given and costs that would plan another split: the recorded split is kept
    costs = HiddenCosts(io_hidden=1.0, io_kv=0.1, c_hidden=1.0, c_token=1.0, overlap=False)
    again = stateful_hf.SessionStore(model, hidden_costs=costs, hidden_budget=None, **kw)
    assert again.config.hidden_spec.hidden_layers == 1 and again.stats("kept").disk_hidden_tokens == on_disk
    again.check_integrity()
    out = greedy(model, conv.ids, cache=again.cache("kept"))
    assert torch.equal(out, greedy(oracle, conv.ids))
    assert again.stats("kept").last_turn.restored_hidden == on_disk
    conv.reply(out)
    ks = range(len(again.session("kept").chunks))
    again.move("kept", ks, "hidden")
    again.move("kept", ks, "disk")
    again.close()
    shutil.copytree(tmp_path / "d", tmp_path / "d2")
    # another split (or no hidden states): those chunks cannot be used; they are recomputed, exactly
    for where, other in (("d", dict(hidden_layers=2)), ("d2", dict(hidden_states="never"))):
        third = stateful_hf.SessionStore(model, **{**kw, "disk_dir": tmp_path / where, **other})
        n = third.session("kept").num_tokens
        assert third.residency("kept")["dropped"] == n
        third.check_integrity()
        out = greedy(model, conv.ids, cache=third.cache("kept"))
        assert torch.equal(out, greedy(oracle, conv.ids)) and third.stats("kept").last_turn.recomputed_tokens == n
        third.close()


def test_disk_bytes_per_token_for_mha(make_store, tmp_path):
    mha = tiny_llama("llama", num_hidden_layers=12, num_key_value_heads=4)   # K+V 128 values/layer, hidden 64
    store = make_store(mha, device_capacity=1024, host_capacity=1024, disk_dir=tmp_path / "d", disk_capacity=1024,
                       cost_profile=PROFILE, hidden_states="auto")
    assert store.config.hidden_spec.hidden_layers >= 11      # the planner under the 0.55 budget
    for i in range(3):
        greedy(mha, torch.arange(3, 131)[None] + i, n=1, cache=store.cache(f"s{i}"))   # 4 chunks each
        store.evict(f"s{i}")
        store.move(f"s{i}", range(4), "disk")
    st = store.stats()
    assert st.disk_tokens == st.disk_hidden_tokens == 3 * 128 and st.host_tokens == 0
    assert st.disk_bytes / st.disk_tokens <= 0.55 * st.kv_bytes_per_token, st
    assert st.bytes_per_token["disk"] == st.hidden_bytes_per_token
    per_slot = store.config.hidden_spec.bytes_per_block
    assert store.tiers.disk.files["hidden"].path.stat().st_size == store.tiers.disk_hidden.num_blocks * per_slot


def test_full_disk_and_bad_moves_are_clear_and_lose_nothing(make_store, tmp_path):
    model = FAMILIES["opt"]()
    store = disk_store(make_store, model, tmp_path, hidden_disk_capacity=64, disk_capacity=64, hidden_layers=2)
    greedy(model, torch.arange(3, 140)[None], n=2, cache=store.cache("a"))
    store.move("a", [0, 1, 2, 3], "hidden")
    before = [(c.state, c.loc) for c in store.session("a").chunks]
    with pytest.raises(CapacityError, match="disk_hidden tier"):
        store.move("a", [0, 1, 2, 3], "disk")       # 4 chunks for 2 slots, no other session to push out
    assert [(c.state, c.loc) for c in store.session("a").chunks] == before
    store.check_integrity()
    store.move("a", [0, 1], "disk")
    with pytest.raises(ValueError, match="hidden chunks move to the device"):
        store.move("a", [0], "host")
    store.move("a", [4], "disk")                    # a device chunk asked to disk keeps K/V there
    assert store.session("a").chunks[4].state is ChunkState.DISK
    with pytest.raises(ValueError, match="only device chunks"):
        store.move("a", [4], "hidden")
    store.move("a", [0], "dropped")
    with pytest.raises(ValueError, match="dropped chunks"):
        store.move("a", [0], "disk")
    store.check_integrity()
    no_disk = make_store(model, host_capacity=256, cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    greedy(model, torch.arange(3, 70)[None], n=2, cache=no_disk.cache("b"))
    no_disk.move("b", [0], "hidden")
    assert no_disk.tiers.disk_hidden is None
    with pytest.raises(ValueError, match="no disk tier"):
        no_disk.move("b", [0], "disk")


def test_disk_profile_reads_the_disk_tier_file(tmp_path):
    from stateful_hf.cache import KVSpec
    from stateful_hf.profile.hidden import measure_hidden_costs

    model = FAMILIES["llama"]()
    adapter = stateful_hf.enable(model)
    spec = KVSpec(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
    host = measure_hidden_costs(model, adapter, spec, tokens=64, repeats=1)
    disk = measure_hidden_costs(model, adapter, spec, tokens=64, repeats=1, disk_dir=tmp_path / "p")
    assert disk is not host and disk.tokens == host.tokens == 64 and not disk.overlap
    assert min(disk.io_hidden, disk.io_kv, disk.c_hidden, disk.c_token) > 0
    assert list((tmp_path / "p").iterdir()) == []         # its temporary tier is gone
