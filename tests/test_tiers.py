"""Tiered session KV: host and disk tiers, movement, ahead-of-time swap-out, partial drop + recompute.
Every state and mix must give exactly the stateless tokens."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy, seed_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stateful_hf
from stateful_hf.cache import ChunkState, CostProfile, StoreError
from stateful_hf.profile.cost import _fit_linear
from stateful_hf.testing import tiny_llama

PROFILE = CostProfile()   # skip measuring in tests that do not test the profile
TIERS = ["device", "host", "disk", "dropped"]


def tiered(make_store, model, tmp_path, **kw):
    kw = {"device_capacity": 2048, "host_capacity": 2048, "disk_dir": tmp_path / "disk", "disk_capacity": 2048,
          "cost_profile": PROFILE, **kw}
    return make_store(model, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "opt-post-ln"])
def test_every_tier_and_mix_is_exact(family, make_store, tmp_path):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = tiered(make_store, model, tmp_path)
    cache = store.cache("a")
    conv = Conversation(seed=seed_of(family), first=70, turn=20)
    layouts = [["host"] * 9, ["disk"] * 9, ["dropped"] * 9, ["dropped", "host", "disk", "device", "host", "dropped"],
               ["disk", "dropped", "host", "device", "dropped", "disk", "host"], ["device"] * 9]
    for layout in layouts + layouts[:2]:
        n_chunks = len(store.session("a").chunks)
        for tier in TIERS:
            ks = [k for k in range(n_chunks) if layout[k % len(layout)] == tier]
            if tier != "dropped":   # dropped chunks cannot move up: drop last
                ks = [k for k in ks if store.session("a").chunks[k].state is not ChunkState.DROPPED]
            store.move("a", ks, tier)
        store.check_integrity()
        before = store.residency("a")
        out = greedy(model, conv.ids, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids)), layout
        turn = store.stats("a").last_turn
        assert turn.swapped_in_host == before["host"] and turn.swapped_in_disk == before["disk"]
        assert turn.recomputed_tokens == before["dropped"]
        conv.reply(out)
    c = store.stats().counters
    assert c.swapped_in_host and c.swapped_in_disk and c.recomputed and c.swapped_out_disk


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), moves=st.lists(
    st.tuples(st.integers(0, 2), st.sets(st.integers(0, 7), max_size=8), st.sampled_from(TIERS)), max_size=6))
def test_random_move_schedules(seed, moves, make_store, tmp_path_factory):
    model, oracle = _models("llama")
    store = make_store(model, device_capacity=640, host_capacity=320, disk_dir=tmp_path_factory.mktemp("d"),
                       disk_capacity=320, cost_profile=PROFILE)
    convs = [Conversation(seed=seed + i, first=20 + 7 * i, turn=11) for i in range(3)]
    for turn in range(3):
        for i, conv in enumerate(convs):
            out = greedy(model, conv.ids, n=6, cache=store.cache(f"s{i}"))
            assert torch.equal(out, greedy(oracle, conv.ids, n=6))
            conv.reply(out)
        for who, chunks, tier in moves[2 * turn: 2 * turn + 2]:
            s = store.session(f"s{who}")
            ks = [k for k in chunks if k < len(s.chunks)]
            if tier != "dropped":
                ks = [k for k in ks if s.chunks[k].state is not ChunkState.DROPPED]
            with contextlib.suppress(stateful_hf.CapacityError):   # a full tier is a clean refusal
                store.move(f"s{who}", ks, tier)
            store.check_integrity()


_CACHE: dict = {}


def _models(family):
    if family not in _CACHE:
        _CACHE[family] = (FAMILIES[family](), FAMILIES[family]())
    return _CACHE[family]


@pytest.mark.parametrize("family,policy", [("llama", "pensieve"), ("opt", "lru")])
def test_budget_pressure_many_sessions(family, policy, make_store, tmp_path):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    # 22 sessions, ~2800 tokens of history in the end, for 384 device + 1024 host + 512 disk tokens
    store = make_store(model, device_capacity=384, host_capacity=1024, disk_dir=tmp_path / "d", disk_capacity=512,
                       policy=policy, cost_profile=PROFILE)
    convs = {f"u{i}": Conversation(seed=100 + i, first=30 + i, turn=10) for i in range(22)}
    hot = ["u0", "u1", "u2"]     # these come back often, between the others
    schedule = [sid for _ in range(3) for i, cold in enumerate(convs)
                for sid in ([cold, hot[i % 3]] if i % 2 else [cold])]
    for sid in schedule:
        conv = convs[sid]
        out = greedy(model, conv.ids, n=6, cache=store.cache(sid))
        assert torch.equal(out, greedy(oracle, conv.ids, n=6)), sid
        conv.reply(out)
        store.check_integrity()
    st_ = store.stats()
    c = st_.counters
    assert c.swapped_out_host and c.swapped_in_host and c.recomputed and c.dropped, c
    assert st_.host_tokens and st_.dropped_tokens
    text = store.summary()
    assert "host" in text and "hit rate" in text


def test_ahead_of_time_swap_out_keeps_shadows(make_store):
    model = FAMILIES["llama"]()
    store = make_store(model, device_capacity=320, host_capacity=1024, cost_profile=PROFILE)   # 10 blocks
    for i in range(4):
        greedy(model, torch.arange(3, 60)[None] + i, n=4, cache=store.cache(f"s{i}"))    # 2 blocks each
    st_ = store.stats()
    # after each turn, >= 25% of device blocks are free or cached copies ready to reclaim without a copy
    assert st_.device_free_blocks * 32 + st_.device_cached_tokens >= 0.25 * 320 - 32
    assert st_.device_cached_tokens > 0 and st_.counters.swapped_out_host > 0
    # a returning session whose chunks are cached on the device takes them back without a copy
    sid = next(s for s in store.session_ids() if any(c.shadow is not None for c in store.session(s).chunks))
    hits = store.stats().counters.swapped_in_host
    i = int(sid[1:])
    ids = torch.cat([greedy(model, torch.arange(3, 60)[None] + i, n=4), torch.tensor([[5, 6]])], 1)
    greedy(model, ids, n=2, cache=store.cache(sid))
    assert store.stats().counters.swapped_in_host == hits
    assert store.stats(sid).last_turn.reused_device == 60


def test_profile_cost_grows_with_context(make_store):
    # the fit (Pensieve's c + a*l) keeps attention's growth and ignores a noisy point
    lengths = [32, 64, 128, 256, 512, 1024]
    noisy = [0.030, 0.011, 0.012, 0.014, 0.019, 0.028]         # a cold first run, then c + a*l
    fitted = CostProfile(tuple(lengths), tuple(_fit_linear(lengths, noisy)))
    assert fitted.cost(1024) > fitted.cost(256) > fitted.cost(32) > 0
    assert _fit_linear(lengths, [0.02] * 6) == pytest.approx([0.02] * 6)   # flat data: flat cost
    # measured on a model: one positive, non-decreasing point per power of two up to the context
    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)
    prof = make_store(model).policy.profile
    assert prof.lengths == (32, 64, 128, 256, 512, 1024)
    assert prof.seconds[0] > 0 and all(a <= b for a, b in zip(prof.seconds, prof.seconds[1:]))


def test_disk_tier_survives_restart(tmp_path):
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    conv = Conversation(seed=7, first=50)
    store = stateful_hf.SessionStore(model, disk_dir=tmp_path / "d", disk_capacity=1024, cost_profile=PROFILE)
    out = greedy(model, conv.ids, cache=store.cache("kept"))
    conv.reply(out)
    store.move("kept", range(len(store.session("kept").chunks)), "disk")
    n = store.session("kept").num_tokens
    assert n == out.shape[1] - 1 and store.stats("kept").disk_tokens == n
    with pytest.raises(StoreError, match="in use"):
        stateful_hf.SessionStore(model, disk_dir=tmp_path / "d", disk_capacity=1024, cost_profile=PROFILE)
    store.close()
    again = stateful_hf.SessionStore(model, disk_dir=tmp_path / "d", disk_capacity=1024, cost_profile=PROFILE)
    assert again.session_ids() == ["kept"] and again.stats("kept").disk_tokens == n
    again.check_integrity()
    out2 = greedy(model, conv.ids, cache=again.cache("kept"))
    assert torch.equal(out2, greedy(oracle, conv.ids))
    assert again.stats("kept").last_turn.swapped_in_disk == n
    again.check_integrity()
    again.close()
    other = FAMILIES["llama"]()
    with pytest.raises(StoreError, match="another geometry"):
        stateful_hf.SessionStore(other, disk_dir=tmp_path / "d", disk_capacity=1024, cost_profile=PROFILE)


def test_bad_moves_are_refused_and_lose_nothing(make_store, tmp_path):
    model = FAMILIES["llama"]()
    store = make_store(model, device_capacity=512, host_capacity=64, disk_dir=tmp_path / "d", disk_capacity=64,
                       cost_profile=PROFILE)
    greedy(model, torch.arange(3, 140)[None], n=4, cache=store.cache("a"))
    ids = list(store.session("a").token_ids)
    with pytest.raises(stateful_hf.UnknownSessionError):
        store.move("nobody", [0], "host")
    with pytest.raises(ValueError, match="unknown tier"):
        store.move("a", [0], "moon")
    with pytest.raises(IndexError):
        store.move("a", [99], "host")
    with store.lease("a"), pytest.raises(stateful_hf.SessionBusyError):
        store.move("a", [0], "host")
    with pytest.raises(stateful_hf.CapacityError, match="disk tier"):
        store.move("a", [0, 1, 2, 3], "disk")       # 4 chunks for a 2-chunk disk
    store.move("a", [0], "dropped")
    with pytest.raises(ValueError, match="dropped"):
        store.move("a", [0], "device")
    assert list(store.session("a").token_ids) == ids
    store.check_integrity()
    nohost = make_store(model, cost_profile=PROFILE)
    nohost.open("a")
    with pytest.raises(ValueError, match="no host tier"):
        nohost.move("a", [], "host")


def test_unwritable_disk_is_a_clear_error(tmp_path):
    model = FAMILIES["llama"]()
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that can write anywhere (root): permissions do not bind")
        with pytest.raises(StoreError, match="not writable"):
            stateful_hf.SessionStore(model, disk_dir=ro / "d", cost_profile=PROFILE)
    finally:
        os.chmod(ro, 0o700)


def test_disk_file_that_cannot_be_created(tmp_path):
    model = FAMILIES["llama"]()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="not writable"):
        stateful_hf.SessionStore(model, disk_dir=blocker / "d", cost_profile=PROFILE)
    with pytest.raises(StoreError, match="cannot create"):
        stateful_hf.SessionStore(model, disk_dir=tmp_path / "big", disk_capacity="64PB", cost_profile=PROFILE)


def test_measured_profile_is_kept_on_disk(tmp_path, monkeypatch):
    import stateful_hf.profile.cost as profile_mod

    monkeypatch.setenv("STATEFUL_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(profile_mod, "_MEASURED", {})               # nothing measured yet in this process
    monkeypatch.setattr(profile_mod, "BUSY_SPREAD", float("inf"))   # however busy this host: calm (saved for reuse)
    model = tiny_llama(seed=5)
    first = stateful_hf.SessionStore(model).policy.profile
    assert list((tmp_path / "cost_profiles").glob("*.json"))
    profile_mod._MEASURED.clear()                                   # a new process, as it were

    def no_measuring(*args, **kwargs):
        raise AssertionError("the saved profile should have been used")

    monkeypatch.setattr(profile_mod, "_sweep", no_measuring)
    assert stateful_hf.SessionStore(model).policy.profile == first
    spec = stateful_hf.SessionStore(model).spec
    longer_calls = []
    monkeypatch.setattr(profile_mod, "_sweep", lambda m, s, ids, lengths, r, bar: longer_calls.append(lengths) or
                        ([1e-3 * (1 + n / 4096) for n in lengths], 0.0))
    assert profile_mod.measure_cost_profile(model, spec, max_length=first.lengths[-1]) == first   # covered: reused
    assert not longer_calls
    short = profile_mod.measure_cost_profile(model, spec, max_length=first.lengths[-1] // 4)     # shorter: reused
    assert short == first and not longer_calls


def test_a_profile_taken_on_a_busy_host_is_measured_again_and_says_so(tmp_path, monkeypatch):
    """Sweeps whose repeats spread widely are taken again (MAX_SWEEPS at most), the calmest kept; a profile still
    disturbed serves this process, is not reused by the next, and `stats().cost_profile` says which it is."""
    import stateful_hf.profile.cost as profile_mod

    monkeypatch.setenv("STATEFUL_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(profile_mod, "_MEASURED", {})
    model = tiny_llama(seed=7)
    spec = stateful_hf.SessionStore(model, cost_profile=PROFILE).spec
    spreads = iter([2.0, 0.9, 1.5, 2.0, 0.1])      # three busy sweeps (0.9 the calmest); later, a calm one
    sweeps = []

    def sweep(m, s, ids, lengths, r, bar):
        spread = next(spreads) if r > 1 else 0.0    # the warm-up sweep (1 repeat) is not judged
        sweeps.append(spread)
        return [spread * 1e-3 * (1 + n / 4096) for n in lengths], spread

    monkeypatch.setattr(profile_mod, "_sweep", sweep)
    busy = profile_mod.measure_cost_profile(model, spec, max_length=256)
    assert sweeps == [0.0, 2.0, 0.9, 1.5] and "spread 0.90, 3 sweeps" in busy.source and "busy" in busy.source
    assert busy.seconds[0] == pytest.approx(0.9e-3 * (1 + 32 / 4096), rel=0.05)       # the calmest sweep's
    assert profile_mod.measure_cost_profile(model, spec, max_length=256) == busy          # this process: memo
    profile_mod._MEASURED.clear()                                                         # a new process
    calm = profile_mod.measure_cost_profile(model, spec, max_length=256)
    assert sweeps[4:] == [0.0, 2.0, 0.1] and "busy" not in calm.source                   # measured again
    profile_mod._MEASURED.clear()
    assert profile_mod.measure_cost_profile(model, spec, max_length=256).source.startswith("cached in")
    assert stateful_hf.SessionStore(model, cost_profile=calm).stats().cost_profile == calm.source


def test_profile_for_a_longer_range_is_measured_again(tmp_path, monkeypatch):
    import stateful_hf.profile.cost as profile_mod

    monkeypatch.setenv("STATEFUL_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(profile_mod, "_MEASURED", {})
    model = tiny_llama(seed=6)
    spec = stateful_hf.SessionStore(model, cost_profile=PROFILE).spec
    swept = []
    monkeypatch.setattr(profile_mod, "_sweep", lambda m, s, ids, lengths, r, bar: swept.append(lengths) or
                        ([1e-3 * (1 + n / 4096) for n in lengths], 0.0))
    short = profile_mod.measure_cost_profile(model, spec, max_length=256)
    assert short.lengths[-1] == 256
    longer = profile_mod.measure_cost_profile(model, spec, max_length=1024)   # not covered: measured again
    assert longer.lengths[-1] == 1024 and swept[-1][-1] == 1024
    profile_mod._MEASURED.clear()
    assert profile_mod.measure_cost_profile(model, spec, max_length=512) == longer       # the longer one was kept
