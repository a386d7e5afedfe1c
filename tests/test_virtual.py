"""vAttention's layout (`layout="virtual"`): exact across chunk states, for generate and the engine,
and honest about memory: resident memory follows committed KV, not the reservation."""

from __future__ import annotations

import ctypes
import gc
import sys
import types

import pytest
import torch
from conftest import FAMILIES, Conversation, engine_round, greedy

import stateful_hf
from stateful_hf.cache import CostProfile
from stateful_hf.cache.spec import KVSpec
from stateful_hf.cache.virtual.mapper import PageMapper
from stateful_hf.cache.virtual.pool import VirtualPool
from stateful_hf.integration.hooks import run_step
from stateful_hf.testing import tiny_llama

PROFILE = CostProfile()


def page_mapper(store) -> PageMapper:
    """The store's background page mapper: its registered feature (layout="virtual", map_ahead)."""
    return next(f for f in store.parts.features if isinstance(f, PageMapper))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_generate_exact_across_chunk_states(family, make_store, tmp_path):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = make_store(model, device_capacity=8192, layout="virtual", host_capacity=1024,
                       disk_dir=tmp_path / "d", disk_capacity=1024, cost_profile=PROFILE)
    assert isinstance(store.tiers.device, VirtualPool)
    cache = store.cache("a")
    conv = Conversation(seed=31, first=70, turn=20)
    for tiers in (["host"], ["disk"], ["dropped"], ["host", "disk", "dropped"], ["device"], ["dropped", "host"]):
        n = len(store.session("a").chunks)
        for i, tier in enumerate(tiers):
            ks = [k for k in range(i, n, len(tiers)) if tier == "dropped"
                  or store.session("a").chunks[k].state.value != "dropped"]
            store.move("a", ks, tier)
        out = greedy(model, conv.ids, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids)), tiers
        conv.reply(out)
        store.check_integrity()


def test_engine_exact_and_slots_recycled(make_store):
    from stateful_hf import Engine

    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    # 3 slots of max_context 256 for 6 sessions: sessions must leave the device for others to enter
    store = make_store(model, device_capacity=3 * 256, layout="virtual", max_context=256, host_capacity=2048,
                       cost_profile=PROFILE)
    assert store.tiers.device.num_slots == 3
    convs = {f"s{i}": Conversation(seed=40 + i, first=20 + i, turn=7) for i in range(6)}
    with Engine(model, store=store, max_batch_tokens=96) as engine:
        for _ in range(3):
            engine_round(engine, convs, oracle, n=5)
    st = store.stats()
    assert st.counters.swapped_in_host > 0 and st.device_reserved_bytes == store.tiers.device.reserved_bytes


def _rss() -> int:
    """Resident bytes, after handing freed heap memory back (so allocator caches do not count)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@torch.inference_mode()
def test_resident_memory_follows_committed_kv(make_store):
    # 16 KiB of KV per token (4 layers x 8 KV heads x 64 dims x K,V x fp32): 7 sessions x 896 tokens ~ 100 MB
    model = tiny_llama(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4,
                       intermediate_size=512)
    with torch.inference_mode():
        model(torch.randint(3, 300, (1, 896)))      # warm the allocator with one forward of the same size
    before = _rss()
    store = make_store(model, device_capacity="8GiB", layout="virtual", max_context=1024, cost_profile=PROFILE)
    pool = store.tiers.device
    assert pool.reserved_bytes >= 8 * 2**30 and _rss() - before < 64 * 2**20   # reserving commits nothing
    for i in range(7):
        store.open(f"s{i}")
        ids = torch.randint(3, 300, (896,)).tolist()
        step = store.plan_step([(f"s{i}", ids, range(896))])
        run_step(model, step)
        store.commit(step)
    page_mapper(store).drain()                          # the background mapper has mapped what it was sent
    kv = 7 * 896 * store.spec.bytes_per_token
    committed = pool.committed_bytes()
    grown = _rss() - before
    assert kv <= committed <= kv * 1.1 + 2**20, (kv, committed)
    assert committed * 0.8 <= grown <= committed + 96 * 2**20, (grown, committed)   # not the 8 GiB reservation
    st = store.stats()
    assert st.device_committed_bytes == committed and st.device_reserved_bytes == pool.reserved_bytes
    for i in range(7):
        store.delete(f"s{i}")
    page_mapper(store).drain()
    kept = store.stats().device_kept_bytes            # deferred reclamation keeps up to keep_freed committed
    assert 0 < kept <= 64 * 2**20 and pool.committed_bytes() <= kept + 2**20, (kept, pool.committed_bytes())
    assert store.reclaim() == kept and store.stats().device_kept_bytes == 0
    assert pool.committed_bytes() < 2**20 and pool.pages_released * 4096 >= kv * 0.9
    assert before - 64 * 2**20 <= _rss() - 0 <= before + committed * 0.2 + 64 * 2**20, (_rss() - before, committed)


@pytest.mark.parametrize("keep_freed", ["64MiB", 0])
def test_reused_slot_reads_zeros(make_store, keep_freed):
    """With deferred reclamation (pages kept) the reused block is zeroed; without it the pages went
    back to the OS: either way a new owner reads zeros."""
    store = make_store(tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=4), device_capacity=4096,
                       layout="virtual", max_context=512, cost_profile=PROFILE, keep_freed=keep_freed)
    pool = store.tiers.device
    blocks = pool.allocate(3, [("x", k) for k in range(3)])
    k, v = pool.layer(0)
    k[blocks] = 7.0
    v[blocks] = float("nan")
    pool.free(blocks)
    assert pool.cached_bytes == (3 * pool.block_bytes if keep_freed else 0)
    assert (pool.pages_released == 0) == bool(keep_freed)
    again = pool.allocate(3, [("y", k) for k in range(3)])
    assert again == blocks and pool.cached_bytes == 0
    assert float(pool.layer(0)[0][again].abs().sum()) == 0.0 and float(pool.layer(0)[1][again].abs().sum()) == 0.0
    before = (pool.num_free, pool.free_slots)
    for bad in ([("z", 0), ("z", 10**6)], [("y", 3), ("y", 1)], [("w", 0), ("w", 0)]):   # past max_context,
        with pytest.raises(ValueError):                                                # in use, twice
            pool.allocate(len(bad), bad)
        assert (pool.num_free, pool.free_slots) == before and pool.slot_of("z") is None and pool.slot_of("w") is None
    pool.free(again)


def _resident(pool, slot: int, k: int) -> bool:
    """Every page of block k of `slot` (all layers, K and V) is resident."""
    from stateful_hf.cache.virtual.pool import _resident_pages
    for rows, _, _ in pool._block_rows(slot, k):
        n = rows.numel() * rows.element_size()
        first = rows.data_ptr() // 4096 * 4096
        if _resident_pages(first, rows.data_ptr() + n - first) * 4096 < rows.data_ptr() + n - first:
            return False
    return True


def test_kept_pages_are_bounded_oldest_first(make_store):
    model = tiny_llama(hidden_size=512, num_attention_heads=8, num_key_value_heads=8)    # 8 KiB per token
    store = make_store(model, device_capacity=4096, layout="virtual", max_context=512, cost_profile=PROFILE,
                       keep_freed=64, map_ahead=False)                                  # 2 blocks of 32 tokens
    pool = store.tiers.device
    blocks = pool.allocate(4, [("x", k) for k in range(4)])
    for k in range(4):
        for rows, _, _ in pool._block_rows(0, k):                                      # commit their pages
            rows.fill_(1.0)
    pool.free(blocks)
    assert pool.cached_bytes == 2 * pool.block_bytes and sorted(pool._cached) == blocks[2:]   # the newest kept
    assert pool.pages_released > 0 and all(_resident(pool, 0, k) for k in (2, 3))
    assert not _resident(pool, 0, 0) and store.reclaim() == 2 * pool.block_bytes and pool.cached_bytes == 0


@torch.inference_mode()
def test_background_mapper_maps_the_next_block_ahead(make_store):
    """After a step that leaves a session's last block at least half full, the mapper thread commits
    the block it grows into while it is still free; the next step takes it without mapping, and the
    output stays exact."""
    model = tiny_llama(hidden_size=512, num_attention_heads=8, num_key_value_heads=8)
    oracle = tiny_llama(hidden_size=512, num_attention_heads=8, num_key_value_heads=8)
    store = make_store(model, device_capacity=4096, layout="virtual", max_context=512, cost_profile=PROFILE)
    pool = store.tiers.device
    conv = Conversation(seed=3, first=20)                 # 20 + 10 generated = 30 tokens: block 0 past half
    out = greedy(model, conv.ids, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, conv.ids))
    page_mapper(store).drain()
    slot = pool.slot_of("a")
    n = store.session("a").num_tokens
    assert n % 32 >= 16 and pool.blocks_prefetched >= 1 and (slot * pool.blocks_per_slot + 1) in pool._cached
    assert _resident(pool, slot, 1) and float(pool.layer(0)[0][slot * pool.blocks_per_slot + 1].abs().sum()) == 0
    assert pool.prefetch([("a", 0), ("nobody", 0), ("a", 10**6)]) == 0                  # in use, no slot, past the end
    conv.reply(out)
    out = greedy(model, conv.ids, cache=store.cache("a"))                               # grows into block 1
    assert torch.equal(out, greedy(oracle, conv.ids))
    assert page_mapper(store).error is None and store.stats().device_blocks_prefetched == pool.blocks_prefetched


def test_a_step_carries_rows_only_over_a_block_pool(make_store):
    """The K/V writer's rows (`BlockPool.slot_rows`) come with a paged store's step, not a virtual one's (each
    entry's KV is its slot's row there: `dense_slots`); either step's logits are the stateless forward's."""
    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    ids = list(range(3, 40))
    with torch.no_grad():
        want = oracle(torch.tensor([ids])).logits[0, -1:]
    for layout, extra, paged in (("paged", {}, True), ("virtual", {"max_context": 256}, False)):
        store = make_store(model, device_capacity=2 * 256, layout=layout, cost_profile=PROFILE, **extra)
        store.open("s")
        step = store.plan_step([("s", ids, list(range(len(ids))))])
        assert (step.rows is not None, step.dense_slots is None) == (paged, paged), layout
        with torch.no_grad():
            logits = run_step(model, step, step.last_rows())
        store.commit(step)
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_bad_virtual_configuration(make_store):
    model = FAMILIES["llama"]()
    with pytest.raises(ValueError, match="holds no slot"):
        stateful_hf.SessionStore(model, device_capacity=64, layout="virtual", max_context=2048, cost_profile=PROFILE)
    with pytest.raises(ValueError, match="layout"):
        stateful_hf.SessionStore(model, layout="sparse", cost_profile=PROFILE)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and cuda-python")
def test_cuda_virtual_memory_exact(make_store):
    pytest.importorskip("cuda.bindings")
    model, oracle = FAMILIES["llama"]().cuda(), FAMILIES["llama"]().cuda()
    store = make_store(model, device_capacity="1GiB", layout="virtual", cost_profile=PROFILE)
    conv = Conversation(seed=5, first=40)
    for _ in range(3):
        ids = conv.ids.cuda()
        out = greedy(model, ids, cache=store.cache("a"))
        assert torch.equal(out, greedy(oracle, ids))
        conv.reply(out.cpu())
    assert 0 < store.tiers.device.committed_bytes() < store.tiers.device.reserved_bytes


class _FakeDriver:
    """A recording stand-in for `cuda.bindings.driver` (needs CUDA): every call goes into `log` as
    (name, address or None); it tracks which granularity pieces are mapped, so `as_tensor` can refuse
    a pointer into an unmapped piece as torch does (it asks the driver for the pointer's device)."""

    GRAN, BASE = 4096, 0x7F00_0000_0000

    def __init__(self):
        self.log: list[tuple[str, int | None]] = []
        self.mapped: set[int] = set()           # mapped piece start addresses
        self.CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
        self.CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
        self.CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    @staticmethod
    def CUmemAllocationProp():
        return types.SimpleNamespace(type=None, location=types.SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():
        return types.SimpleNamespace(location=None, flags=None)

    def _call(self, name, addr=None, *out):
        self.log.append((name, addr))
        return (0, *out)

    def cuDeviceGet(self, index):
        return self._call("cuDeviceGet", None, index)

    def cuDevicePrimaryCtxRetain(self, dev):
        return self._call("cuDevicePrimaryCtxRetain", None, "ctx")

    def cuDevicePrimaryCtxRelease(self, dev):
        return self._call("cuDevicePrimaryCtxRelease")

    def cuCtxSetCurrent(self, ctx):
        return self._call("cuCtxSetCurrent")

    def cuMemGetAllocationGranularity(self, prop, flags):
        return self._call("cuMemGetAllocationGranularity", None, self.GRAN)

    def cuMemAddressReserve(self, nbytes, alignment, addr, flags):
        return self._call("cuMemAddressReserve", self.BASE, self.BASE)

    def cuMemAddressFree(self, addr, nbytes):
        return self._call("cuMemAddressFree", addr)

    def cuMemCreate(self, nbytes, prop, flags):
        return self._call("cuMemCreate", None, object())

    def cuMemMap(self, addr, nbytes, offset, handle, flags):
        self.mapped.add(addr)
        return self._call("cuMemMap", addr)

    def cuMemSetAccess(self, addr, nbytes, access, count):
        return self._call("cuMemSetAccess", addr)

    def cuMemsetD8(self, addr, value, nbytes):
        return self._call("cuMemsetD8", addr)

    def cuMemUnmap(self, addr, nbytes):
        self.mapped.discard(addr)
        return self._call("cuMemUnmap", addr)

    def cuMemRelease(self, handle):
        return self._call("cuMemRelease")

    def as_tensor(self, obj, device=None):
        """torch.as_tensor over a `__cuda_array_interface__`: the pointer must lie in a mapped piece."""
        iface = obj.__cuda_array_interface__
        addr = iface["data"][0]
        if addr - addr % self.GRAN not in self.mapped:
            raise RuntimeError(f"as_tensor: no device for pointer {addr:#x} (unmapped)")
        self.log.append(("tensor", addr))
        return torch.zeros(iface["shape"], dtype=torch.uint8)      # CPU memory stands in for the range


@pytest.fixture
def fake_cuda_driver(monkeypatch):
    drv = _FakeDriver()
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = drv
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch, "as_tensor", drv.as_tensor)
    stream = types.SimpleNamespace(synchronize=lambda: drv.log.append(("synchronize", None)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return drv


def test_cuda_pool_maps_its_first_piece_before_the_tensor_over_the_range(fake_cuda_driver):
    """The CUDA path on a CPU, through a recording fake of the driver: the pool's creation maps piece 0
    (create, map, set access) before it makes the tensor over the reserved range (torch asks the driver
    for the pointer's device, and an unmapped address has none); piece 0 stays mapped while the pool
    lives, and a released block's pages are unmapped only after the stream is synchronised."""
    drv = fake_cuda_driver
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=64, device=torch.device("cuda", 0), block_size=16)
    pool = VirtualPool(spec, capacity_blocks=8, max_context=64, keep_bytes=0)      # 2 slots of 4 blocks
    names = [name for name, _ in drv.log]
    first_tensor = names.index("tensor")
    assert names.index("cuMemAddressReserve") < names.index("cuMemMap") < first_tensor
    assert ("cuMemMap", drv.BASE) in drv.log[:first_tensor] and ("cuMemSetAccess", drv.BASE) in drv.log[:first_tensor]
    assert drv.log[first_tensor] == ("tensor", drv.BASE) and names.count("tensor") == 1
    assert pool.committed_bytes() == drv.GRAN                     # the anchor: one piece before any block
    blocks = pool.allocate(2, [("a", 0), ("b", 3)])                # slot 1's block 3: the far end of the range
    assert pool.committed_bytes() > drv.GRAN
    del drv.log[:]
    pool.free(blocks)                                              # keep_bytes=0: pages go back at once
    names = [name for name, _ in drv.log]
    assert "cuMemUnmap" in names and names.index("synchronize") < names.index("cuMemUnmap")
    assert drv.BASE in drv.mapped and pool.committed_bytes() == drv.GRAN   # piece 0 outlives its blocks


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_virtual_with_hidden_states_and_every_tier(family, make_store, tmp_path):
    from test_hidden import lay_out

    model, oracle = FAMILIES[family](), FAMILIES[family]()
    store = make_store(model, device_capacity=8192, layout="virtual", host_capacity=2048, disk_dir=tmp_path / "d",
                       disk_capacity=2048, cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    cache = store.cache("a")
    conv = Conversation(seed=77, first=70, turn=20)
    conv.reply(greedy(model, conv.ids, cache=cache))
    for layout in (["hidden"] * 9, ["dropped", "hidden", "disk", "hidden", "host", "device"]):
        lay_out(store, "a", layout)
        before = store.residency("a")
        out = greedy(model, conv.ids, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids)), layout
        assert store.stats("a").last_turn.restored_hidden == before["hidden"] > 0
        conv.reply(out)


def test_slot_holders_returning_with_a_new_session_do_not_overcommit_slots(make_store):
    from stateful_hf import Engine

    model, oracle = FAMILIES["llama"](), FAMILIES["llama"]()
    store = make_store(model, device_capacity=2 * 256, layout="virtual", max_context=256, host_capacity=2048,
                       cost_profile=PROFILE)
    convs = {s: Conversation(seed=90 + i, first=20, turn=6) for i, s in enumerate("ACB")}
    with Engine(model, store=store, max_batch_tokens=128) as engine:
        engine_round(engine, {s: convs[s] for s in "AC"}, oracle, n=4)        # A and C now hold both slots
        # a new session first, then both holders: admitting all three at once would need 3 slots
        engine_round(engine, {s: convs[s] for s in "BAC"}, oracle, n=4)
