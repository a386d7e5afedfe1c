"""HCache's per-layer cost profile on the model: the costs its layer planner
(`stateful_hf/cache/hidden/partition.py`) splits layers by, measured through the store's own restore code.
(Capture and restore themselves run in the step's `before_layer`: `stateful_hf/cache/step.py`.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time

import torch

from ..cache.disk.tier import DiskTier
from ..cache.hidden.partition import HiddenCosts
from ..cache.hidden.states import HiddenCapture, HiddenPool, HiddenRestore, HiddenSpec
from ..cache.pools.pool import BlockPool
from ..cache.spec import KVSpec
from ..integration.adapter import ModelAdapter
from ..integration.projector import kv_projector

_MEASURED: dict[str, HiddenCosts] = {}


def _median_seconds(fn, repeats: int, sync, setup=lambda: None) -> float:
    fn()                                        # warm up: allocation and dispatch stay out of timings
    runs = []
    for _ in range(repeats):
        setup()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return sorted(runs)[len(runs) // 2]


class _Fixture:
    """n chunks of random hidden states (layer 0) and K/V (layers 1..) in a host hidden pool, and
    their restore into a device pool one layer at a time through the store's own code."""

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, spec: KVSpec, n: int):
        self.spec, self.n, dev = spec, n, spec.device
        self.hspec = HiddenSpec(spec, adapter.hidden_size, 1)          # layer 0 hidden, layers 1.. KV
        self.host = HiddenPool(self.hspec, n, "cpu", pin_memory=dev.type == "cuda")
        self.host.hidden.normal_()
        self.host.kv.normal_()
        self.device_pool = BlockPool(spec, n)
        self.src = torch.arange(n)
        self.capture, self.project = HiddenCapture(self.hspec, n), kv_projector(model, adapter)
        self.sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def read_hidden(self, pool: HiddenPool):
        return lambda: pool.hidden[0].index_select(0, self.src).to(self.spec.device)

    def run_layer(self, pool: HiddenPool, layer: int):
        restore = HiddenRestore(self.capture, self.project)
        for b in range(self.n):
            restore.add(pool, b, b, b * self.spec.block_size, self.spec.block_size)

        def run():
            restore.done.clear()
            restore.run(layer, self.device_pool)
        return run


@torch.inference_mode()
def measure_hidden_costs(model: torch.nn.Module, adapter: ModelAdapter, spec: KVSpec, tokens: int = 1024,
                         repeats: int = 3, disk_dir: str | os.PathLike | None = None) -> HiddenCosts:
    """HCache's per-layer profile for `tokens` tokens (a whole number of chunks), measured on the
    model's device through the same code the store restores with:
    io_hidden: copy one layer of hidden chunks from the host pool up; io_kv: copy one layer of K/V
    chunks from a host pool into the device pool; c_hidden: project one layer's hidden states to K/V
    and write them into the pool; c_token: a forward of the whole model on the tokens, per layer.
    With `disk_dir`, io_hidden and io_kv are instead reads of a disk tier's hidden file (created in
    a temporary directory there), each from a cold page cache; the compute costs are the host
    profile's. Layers of these families are identical, so one layer stands for each. Memoized per
    geometry (and disk directory)."""
    where = "host" if disk_dir is None else f"disk:{os.path.realpath(disk_dir)}"
    key = hashlib.sha1(f"{json.dumps(model.config.to_dict(), sort_keys=True, default=str)}|{spec}|{tokens}|{where}"
                       .encode()).hexdigest()
    if key in _MEASURED:
        return _MEASURED[key]
    n = max(tokens // spec.block_size, 1)
    fx = _Fixture(model, adapter, spec, n)
    if disk_dir is None:
        io_h = _median_seconds(fx.read_hidden(fx.host), repeats, fx.sync)
        io_kv = _median_seconds(fx.run_layer(fx.host, 1), repeats, fx.sync)
        c_h = max(_median_seconds(fx.run_layer(fx.host, 0), repeats, fx.sync) - io_h, io_h * 1e-3)
        x = torch.randint(0, adapter.vocab_size, (1, n * spec.block_size), device=spec.device)
        forward = _median_seconds(lambda: model.base_model(input_ids=x, use_cache=False), repeats, fx.sync)
        costs = HiddenCosts(io_hidden=io_h, io_kv=io_kv, c_hidden=c_h, c_token=forward / adapter.num_layers,
                            overlap=spec.device.type == "cuda", tokens=n * spec.block_size)
    else:
        base = measure_hidden_costs(model, adapter, spec, tokens, repeats)
        os.makedirs(disk_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
            disk = DiskTier(spec, tmp, 1)
            try:
                disk.open_hidden(fx.hspec, n)
                fx.host.copy_slots(list(range(n)), disk.hidden_pool, list(range(n)))
                cold = disk.drop_page_cache
                io_h = _median_seconds(fx.read_hidden(disk.hidden_pool), repeats, fx.sync, cold)
                io_kv = _median_seconds(fx.run_layer(disk.hidden_pool, 1), repeats, fx.sync, cold)
            finally:
                disk.close()
        costs = dataclasses.replace(base, io_hidden=io_h, io_kv=io_kv)
    _MEASURED[key] = costs
    return costs
