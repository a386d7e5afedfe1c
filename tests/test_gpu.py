"""GPU paths. Tests marked `cuda` run only on a CUDA machine (`python -m benchmarks.gpu_check` runs
them): tiers, side-stream copies, hidden capture and layer-wise staging exact against stateless
generate in float32, and the bf16 agreement rate. The others run everywhere: FlashInfer's wrapper
and workspace are made once per store and planned once per step (with a recording stand-in for the
flashinfer package, which needs CUDA), and the GPU check's CPU behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch
from conftest import FAMILIES, Conversation, greedy

from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CostProfile
from stateful_hf.kernels import KernelState, PagedBatch, flashinfer_backend

PROFILE = CostProfile()


def cuda(f):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f))



def _turns(store, model, oracle, moves, n_turns=3) -> list[bool]:
    """Turns of two sessions; after each, `moves(store, sid, turn)` moves chunks. Per output: equal
    to stateless generate?"""
    convs = [Conversation(seed=7 + i, first=70, turn=20) for i in range(2)]
    same = []
    for turn in range(n_turns):
        for i, conv in enumerate(convs):
            ids = conv.ids.to(model.device)
            out = greedy(model, ids, cache=store.cache(f"s{i}"))
            same.append(torch.equal(out, greedy(oracle, ids)))
            conv.reply(out.cpu())
            moves(store, f"s{i}", turn)
        store.check_integrity()
    return same


def _tiers(store, sid, turn):
    n = len(store.session(sid).chunks)
    store.move(sid, range(0, n, 2), ("host", "disk", "dropped")[turn % 3])
    store.move(sid, range(1, n, 2), ("disk", "host", "device")[turn % 3])


@cuda
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_cuda_tiers_and_side_stream_copies_exact(family, make_store, tmp_path):
    model, oracle = FAMILIES[family]().cuda(), FAMILIES[family]().cuda()
    store = make_store(model, 256, host_capacity=512, disk_dir=tmp_path / "d", disk_capacity=512,
                       cost_profile=PROFILE, swap_out_threshold=0.5, attn_backend="torch")
    assert all(_turns(store, model, oracle, _tiers))
    c = store.stats().counters
    assert c.swapped_in_host and c.swapped_in_disk and c.swapped_out_host


@cuda
def test_cuda_hidden_capture_exact(make_store):
    model, oracle = FAMILIES["llama"]().cuda(), FAMILIES["llama"]().cuda()
    store = make_store(model, 512, host_capacity=1024, hidden_states="always", hidden_layers=1,
                       cost_profile=PROFILE, attn_backend="torch")

    def moves(st, sid, turn):
        st.move(sid, range(len(st.session(sid).chunks)), "hidden" if turn % 2 == 0 else "host")

    assert all(_turns(store, model, oracle, moves))


@cuda
@pytest.mark.parametrize("stage", [None, True])
def test_cuda_layerwise_staging_exact(stage, make_store):
    model, oracle = FAMILIES["llama"]().cuda(), FAMILIES["llama"]().cuda()
    store = make_store(model, 256, chunk_size=16, host_capacity=8192, cost_profile=PROFILE, layerwise_kv=True,
                       attn_backend="torch")
    store.layerwise_stage = stage
    engine = Engine(model, store=store, max_batch_tokens=128, layerwise_kv=True)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (400, 90, 300)]
    outs = engine.generate([f"s{i}" for i in range(3)], prompts, SamplingParams(max_new_tokens=8))
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        assert o.error is None and list(o.token_ids) == greedy(oracle, ids, n=8)[0, len(p):].tolist()


@cuda
def test_cuda_bf16_agreement_rate(make_store, record_property):
    """bf16 is not exact (kernels differ in summation order): report the share of greedy tokens equal
    to stateless bf16 generate; a rate far below 1 means a wrong path, not rounding."""
    model, oracle = (FAMILIES["llama"]().cuda().to(torch.bfloat16) for _ in range(2))
    store = make_store(model, 256, host_capacity=512, cost_profile=PROFILE)
    agree = total = 0
    convs = [Conversation(seed=40 + i, first=60, turn=16) for i in range(3)]
    for _ in range(3):
        for i, conv in enumerate(convs):
            ids = conv.ids.cuda()
            out, ref = greedy(model, ids, cache=store.cache(f"b{i}")), greedy(oracle, ids)
            agree += int((out[0, ids.shape[1]:] == ref[0, ids.shape[1]:]).sum())
            total += out.shape[1] - ids.shape[1]
            conv.reply(out.cpu())
            store.move(f"b{i}", range(len(store.session(f"b{i}").chunks)), "host")
    record_property("bf16_agreement", agree / total)
    print(f"bf16_agreement={agree / total:.4f}")
    assert agree / total > 0.8


class _FakeWrapper:
    made, plans = 0, 0

    def __init__(self, workspace, layout):
        type(self).made += 1

    def plan(self, *args, **kwargs):
        type(self).plans += 1

    def run(self, query, caches):
        return torch.zeros_like(query)


def test_flashinfer_one_wrapper_per_store_planned_once_per_step(monkeypatch):
    """The wiring only (FlashInfer itself needs CUDA): a recording stand-in for the package counts
    wrappers made and plan() calls over 3 steps of 4 layers each, with a window change in step 3."""
    fake = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper)
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "WORKSPACE_BYTES", 1024)
    state = KernelState()
    batch = PagedBatch(torch.tensor([0, 3]), torch.tensor([0, 1, 2]), torch.tensor([3]), torch.tensor([[0]]))
    q, kc = torch.zeros(3, 2, 8, dtype=torch.float16), torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    for step in range(3):
        plan = flashinfer_backend.FlashInferPlan(batch, 4, shared=state.flashinfer("cpu"))
        for layer in range(4):
            plan.run(q, kc, kc, 0.5, window=2 if step == 2 and layer % 2 else None)
    assert _FakeWrapper.made == 1
    assert _FakeWrapper.plans == 2 + 4     # once in steps 1 and 2; step 3 alternates windows every layer
    assert state.flashinfer("cpu") is state.flashinfer("cpu")


def test_gpu_check_on_cpu_says_it_needs_cuda(tmp_path):
    out = tmp_path / "o.json"
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run for real")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--json", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "needs CUDA" in r.stdout and not out.exists()
    h = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert h.returncode == 0 and "CUDA build of torch" in h.stdout and '.[dev,gpu]' in h.stdout


def test_gpu_check_smoke_writes_every_figure(tmp_path):
    """--smoke runs every benchmark step at tiny sizes on this device: the JSON has each section, no errors."""
    out = tmp_path / "smoke.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--no-tests", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["device"] and report["smoke"] is True
    for section in ("kernels", "tiers", "hidden", "engine"):
        assert "error" not in report[section], report[section]
    assert report["tiers"]["swap_in_host_s"] > 0 and report["engine"]["turn2"]["tokens_per_s"] > 0
    assert not report["engine"]["turn1"]["errors"]
