"""The CPU async emulator (stateful_hf/cache/movement/transfer.py) and the ordering rules it checks: destinations read
poison until their copy lands, sources are held back (lazy free) until it lands, and breaking the
lazy free makes tiered generation wrong under the emulator."""

from __future__ import annotations

import pytest
import torch
from conftest import Conversation, greedy

from stateful_hf.cache import CostProfile, KVSpec, KVStore
from stateful_hf.testing import tiny_llama

PROFILE = CostProfile()
CPU = torch.device("cpu")


def _store(**kw) -> KVStore:
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32, device=CPU)
    return KVStore(spec, 32, host_capacity=32, **{"emulate_async": True, **kw})


def test_switch_env_and_argument(monkeypatch, make_store):
    monkeypatch.delenv("STATEFUL_HF_EMULATE_ASYNC", raising=False)
    assert not _store(emulate_async=False).transfer.emulate and _store().transfer.emulate
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32, device=CPU)
    assert not KVStore(spec, 8).transfer.emulate
    monkeypatch.setenv("STATEFUL_HF_EMULATE_ASYNC", "1")
    assert KVStore(spec, 8).transfer.emulate
    assert make_store(tiny_llama(), 64, cost_profile=PROFILE).transfer.emulate
    with pytest.deprecated_call():                 # the alias docs/gpu.md showed, kept for one release
        assert KVStore(spec, 8).emulate_async


def test_destination_reads_poison_until_waited_and_sources_are_freed_lazily():
    store = _store()
    dev, host, tr = store.tiers.device, store.tiers.host, store.transfer
    src = dev.allocate(2)
    dev.data[:, src] = torch.arange(dev.data[:, src].numel(), dtype=torch.float32).view_as(dev.data[:, src])
    want = dev.data[:, src].clone()
    dst = host.allocate(2)
    free_before = dev.num_free
    events = tr.copy(dev, src, host, dst)
    assert len(events) == 2 and not events[0].query()
    assert torch.isnan(host.data[:, dst]).all()           # not landed: poison
    dev.free(src)                                         # lazy: held back, still counted free
    assert dev.num_free == free_before + 2 and sorted(tr.deferred_ids(dev)) == sorted(src)
    assert not set(src) & set(dev.free_ids())
    dev.check(set(range(dev.num_blocks)) - set(dev.free_ids()) - set(src))
    assert torch.equal(dev.data[:, src], want)            # the source is intact until the copy read it
    events[1].synchronize()                               # one layer lands
    assert torch.equal(host.data[1, dst], want[1]) and torch.isnan(host.data[0, dst]).all()
    tr.settle(host)
    assert torch.equal(host.data[:, dst], want) and not tr.deferred_ids(dev)
    assert set(src) <= set(dev.free_ids())


def test_allocation_waits_for_held_back_blocks():
    store = _store()
    dev, host, tr = store.tiers.device, store.tiers.host, store.transfer
    src = dev.allocate(dev.num_blocks)
    dev.data[:, src] = 1.0
    dst = host.allocate(2)
    tr.copy(dev, src[:2], host, dst)
    dev.free(src[:2])
    assert len(dev.allocate(2)) == 2                      # lands the copy, then hands the blocks out
    assert torch.equal(host.data[:, dst], torch.ones_like(host.data[:, dst]))


def _tiered_turns(store, model, oracle) -> bool:
    """Three turns of two sessions with their chunks pushed to host / disk between turns; True when
    every output is the stateless one."""
    convs = [Conversation(seed=11 + i, first=40, turn=9) for i in range(2)]
    for turn in range(3):
        for i, conv in enumerate(convs):
            out = greedy(model, conv.ids, n=6, cache=store.cache(f"s{i}"))
            if not torch.equal(out, greedy(oracle, conv.ids, n=6)):
                return False
            conv.reply(out)
            n = len(store.session(f"s{i}").chunks)
            store.move(f"s{i}", range(n), "host" if turn % 2 == 0 else "disk")
        store.check_integrity()
    return True


def test_tiers_exact_under_the_emulator_and_wrong_without_lazy_free(make_store, tmp_path):
    model, oracle = tiny_llama(), tiny_llama()
    kw = {"host_capacity": 256, "disk_dir": tmp_path / "a", "disk_capacity": 256, "cost_profile": PROFILE,
          "emulate_async": True}
    assert _tiered_turns(make_store(model, 160, **kw), model, oracle)
    broken = make_store(model, 160, **{**kw, "disk_dir": tmp_path / "b"})
    broken.transfer.lazy_free = False          # sources return to the free list before their copy ran
    assert not _tiered_turns(broken, model, oracle)
