"""Every pool keeps the `TierPool` protocol (`stateful_hf/cache/pools/tier.py`) and declares what callers tell
pools apart by; each is given the store's transfer engine when made; every kind of copy between tiers is
a `Transfer` method that copies exactly and is counted; nothing in the store's core probes a pool."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from conftest import Conversation, greedy

import stateful_hf
from stateful_hf.cache import ChunkState, KVSpec
from stateful_hf.cache.hidden.states import HiddenCapture, HiddenPool, HiddenSpec
from stateful_hf.cache.movement.transfer import Transfer
from stateful_hf.cache.pools.pool import BlockPool
from stateful_hf.cache.pools.tier import TierPool
from stateful_hf.cache.virtual.pool import VirtualPool
from stateful_hf.testing import tiny_llama

PROFILE = stateful_hf.cache.CostProfile()
SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
CACHE = Path(__file__).resolve().parent.parent / "stateful_hf" / "cache"


def test_every_pool_of_a_store_keeps_the_protocol_and_holds_its_transfer(make_store, tmp_path):
    store = make_store(tiny_llama(), 512, host_capacity=512, disk_dir=tmp_path / "d", disk_capacity=512,
                       cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    t = store.tiers
    pools = {"device": t.device, "host": t.host, "disk": t.disk.pool, "hidden": t.hidden, "disk_hidden": t.disk_hidden}
    for name, pool in pools.items():
        assert isinstance(pool, TierPool), name
        assert pool.transfer is store.transfer, name
        assert pool.device_tier == (name == "device") and not pool.virtual, name
        assert pool.slice_blocks == (name in ("device", "host")), name     # the disk tier writes through its file
        assert (pool.pages_released, pool.cached_bytes, pool.blocks_prefetched) == (0, 0, 0), name
    kv, hidden = store.tiers.device.spec.bytes_per_block, t.hidden.hidden_spec.bytes_per_block
    assert [p.bytes_per_slot for p in pools.values()] == [kv, kv, kv, hidden, hidden]


def test_a_virtual_device_pool_keeps_the_protocol(make_store):
    store = make_store(tiny_llama(), 512, layout="virtual", max_context=128, cost_profile=PROFILE)
    pool = store.tiers.device
    assert isinstance(pool, VirtualPool) and isinstance(pool, TierPool)
    assert pool.virtual and pool.device_tier and not pool.slice_blocks and pool.transfer is store.transfer
    assert pool.bytes_per_slot == pool.spec.bytes_per_block


def _pools(transfer: Transfer) -> tuple[BlockPool, BlockPool]:
    dev = BlockPool(SPEC, 8, transfer=transfer, device_tier=True)
    host = BlockPool(SPEC, 8, "cpu", transfer=transfer)
    dev.data.copy_(torch.randn(dev.data.shape))
    return dev, host


def test_copy_layers_copies_the_named_layers_only_and_counts():
    tr = Transfer(torch.device("cpu"))
    dev, host = _pools(tr)
    want = host.data.clone()
    moves = [(0, [1, 2], [5, 6]), (1, [], []), (2, [3], [0])]
    for layer, s, d in moves:
        for a, b in zip(s, d):
            want[layer, b] = dev.data[layer, a]
    tr.copy_layers(dev, host, moves)
    assert torch.equal(host.data, want) and tr.issued["layers"] == 3


def test_copy_layers_settles_its_source_under_the_emulator():
    tr = Transfer(torch.device("cpu"), emulate=True)
    dev, host = _pools(tr)
    other = BlockPool(SPEC, 8, "cpu", transfer=tr)
    other.data.copy_(torch.randn(other.data.shape))
    tr.copy(other, [4], dev, [2])                 # queued: block 2 of the device reads NaN until it lands
    tr.copy_layers(dev, host, [(layer, [2], [7]) for layer in range(SPEC.num_layers)])
    assert torch.equal(host.data[:, 7], other.data[:, 4])
    assert tr.issued == {"blocks": 1, "layers": 3, "hidden": 0, "hidden_slots": 0, "exported": 0, "imported": 0,
                         "duplicated": 0}


def test_hidden_copies_go_through_the_transfer():
    tr = Transfer(torch.device("cpu"))
    spec = HiddenSpec(SPEC, hidden_size=6, hidden_layers=1)
    dev, _ = _pools(tr)
    capture = HiddenCapture(spec, dev.num_blocks)
    capture.data.copy_(torch.randn(capture.data.shape))
    a, b = HiddenPool(spec, 4, transfer=tr), HiddenPool(spec, 4, transfer=tr)
    tr.store_hidden(capture, dev, [3, 5], a, [0, 1])
    assert torch.equal(a.hidden[0, :2], capture.data[0, [3, 5]]) and torch.equal(a.kv[:, :2], dev.data[1:, [3, 5]])
    tr.copy_hidden(a, [0, 1], b, [2, 3])
    assert torch.equal(b.hidden[:, 2:], a.hidden[:, :2]) and torch.equal(b.kv[:, 2:], a.kv[:, :2])
    assert tr.issued == {"blocks": 0, "layers": 0, "hidden": 2, "hidden_slots": 2, "exported": 0, "imported": 0,
                         "duplicated": 0}


def test_a_store_issues_hidden_and_disk_copies_through_its_transfer(make_store, tmp_path):
    model, oracle = tiny_llama(), tiny_llama()
    store = make_store(model, 512, host_capacity=512, disk_dir=tmp_path / "d", disk_capacity=512,
                       cost_profile=PROFILE, hidden_states="always", hidden_layers=1)
    conv = Conversation(seed=3, first=40, turn=9)
    for turn in range(2):         # chunks become hidden from the device (captured), then K/V from the host
        out = greedy(model, conv.ids, n=4, cache=store.cache("a"))
        assert torch.equal(out, greedy(oracle, conv.ids, n=4))
        conv.reply(out)
        ks = [k for k, c in enumerate(store.session("a").chunks) if c.state is ChunkState.DEVICE]
        store.move("a", ks, "hidden" if turn % 2 == 0 else "host")
        store.move("a", range(len(store.session("a").chunks)), "disk")
    issued = store.transfer.issued
    assert issued["blocks"] and issued["hidden"] and issued["hidden_slots"], issued


def _probes(path: Path) -> list[str]:
    """getattr / hasattr calls naming a member of the pool protocol (or a pool's own tensors)."""
    names = set(TierPool.__annotations__) | {n for n in vars(TierPool) if not n.startswith("_")}
    names |= {"hidden_spec", "hidden", "kv", "limbo"}
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names:
            out.append(f"{path.relative_to(CACHE.parent.parent)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_nothing_in_the_store_probes_a_pool():
    found = [p for path in sorted(CACHE.rglob("*.py")) for p in _probes(path)]
    assert not found, found
