"""Layer-wise KV allocation (LayerKV): per-layer residency of chunks (device residue block + host slot), exact
against stateless generate for Llama and OPT, prompts longer than the device pool, push-down, the
residue table's integrity, x_min and keep factor choice, and bad configuration."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kernels import assert_close_to_reference, ragged_case

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.cache import CapacityError, ChunkState, CostProfile, KVSpec, KVStore
from stateful_hf.cache.layerwise.residues import ResidueTable, kept_layers
from stateful_hf.engine.layer_offload import LayerwisePolicy
from stateful_hf.integration.hooks import run_step
from stateful_hf.kernels import Overlay, paged_attention
from stateful_hf.testing import tiny_llama, tiny_opt

PROFILE = CostProfile()      # ~1 s per chunk: prefill always hides the offload, x_min = 0
FAMILIES = {"llama": lambda: tiny_llama("llama", num_hidden_layers=6), "opt": lambda: tiny_opt(num_hidden_layers=4)}
_MODELS: dict = {}


def models(family):
    if family not in _MODELS:
        _MODELS[family] = (FAMILIES[family](), FAMILIES[family]())
    return _MODELS[family]


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def expected(oracle, ids: list[int], n: int) -> list[int]:
    return greedy(oracle, torch.tensor([ids]), n)[0, len(ids):].tolist()


def layered_store(make_store, model, device=256, host=8192, **kw):
    return make_store(model, device, chunk_size=16, host_capacity=host, cost_profile=PROFILE, layerwise_kv=True,
                      attn_backend="torch", **kw)


# ---- kernel: the overlay ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ragged_case(head_dims=(64,), max_len=48), st.integers(0, 2**31 - 1))
def test_overlay_reads_moved_blocks_from_the_other_source(case, seed):
    """Blocks moved out of the pool (left NaN there) and read through an overlay give the reference."""
    query, kc, vc, batch, window = case
    g = torch.Generator().manual_seed(seed)
    num_blocks = kc.shape[0]
    moved = [b for b in range(num_blocks) if torch.rand((), generator=g) < 0.5]
    host_ids = {b: i for i, b in enumerate(torch.randperm(len(moved), generator=g).tolist())}
    host_ids = {b: host_ids[i] for i, b in enumerate(moved)}
    hk = torch.full((len(moved) + 1, *kc.shape[1:]), float("nan"))
    hv = hk.clone()
    pool_k, pool_v = kc.clone(), vc.clone()
    for b, h in host_ids.items():
        hk[h], hv[h] = kc[b], vc[b]
        pool_k[b], pool_v[b] = float("nan"), float("nan")
    table = batch.block_table.clone()
    over = torch.full_like(table, -1)
    for i in range(table.shape[0]):
        for j in range(-(-int(batch.kv_len[i]) // kc.shape[1])):
            over[i, j] = host_ids.get(int(table[i, j]), -1)
    out = paged_attention(query, pool_k, pool_v, batch, backend="torch", window=window,
                          overlay=Overlay(over, hk, hv))
    assert_close_to_reference(out, query, kc, vc, batch, window)


def test_overlay_shape_mismatch_raises():
    kc = torch.zeros(4, 16, 2, 8)
    batch = stateful_hf.kernels.PagedBatch(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1]),
                                           torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="overlay table"):
        bad = Overlay(torch.zeros(2, 1, dtype=torch.int32), kc, kc)
        paged_attention(torch.zeros(1, 2, 8), kc, kc, batch, overlay=bad)


# ---- the residue table and kept layers ------------------------------------------------------------------

def test_kept_layers_are_evenly_spaced():
    assert kept_layers(8, 2, 1) == [1, 3, 5, 7]          # LayerKV's example: 8 layers keeping 4
    assert kept_layers(8, 1, 0) == list(range(8)) and kept_layers(8, 0, 0) == []
    assert sorted(sum((kept_layers(6, 4, r) for r in range(4)), [])) == list(range(6))


def test_residue_table_places_distinct_residues_and_frees_empty_blocks():
    t = ResidueTable()
    assert t.blocks_needed(3, 4) == 2 and t.blocks_needed(1, 4) == 0 and t.blocks_needed(0, 4) == 0
    placed = t.place(3, [("a", k) for k in range(4)], [7, 9])
    assert placed == [(7, 0), (7, 1), (7, 2), (9, 0)]
    assert t.free_residues(3) == 2 and t.blocks_needed(3, 2) == 0 and t.blocks_needed(3, 3) == 1
    assert t.place(3, [("b", 0)], []) == [(9, 1)]
    assert not t.release(7, 0) and not t.release(7, 1)
    assert t.release(7, 2) and 7 not in t.blocks
    with pytest.raises(ValueError, match="need"):
        t.place(2, [("c", 0)], [])


def test_integrity_catches_a_residue_owned_twice(make_store):
    model, _ = models("llama")
    store = layered_store(make_store, model)
    store.open("a")
    with store.lease("a"):            # LAYERED chunks live while the turn does
        step = store.plan_step([("a", prompt(0, 40), list(range(40)))], factors=[3])
        store.commit(step)
        store.check_integrity()
        a, b = store.session("a").chunks[:2]
        # one block, two residues
        assert a.residue_block[0] == b.residue_block[0] and a.residue_block[2] != b.residue_block[2]
        saved = b.residue_block
        b.residue_block = a.residue_block
        with pytest.raises(AssertionError, match="owned twice"):
            store.check_integrity()
        b.residue_block = saved
    assert store.session("a").chunks[0].state is ChunkState.HOST and not store.tiers.residues.blocks
    store.delete("a")
    assert store.free_blocks() == store.tiers.device.num_blocks and not store.tiers.residues.blocks


# ---- exactness through the store -----------------------------------------------------------------------

@pytest.mark.parametrize("family, stage", [("llama", None), ("opt", None), ("llama", True)])
def test_every_keep_factor_exact_with_residue_blocks_and_push_down(family, stage, make_store):
    """Sessions of different keep factors prefill in chunks and decode together in the same steps,
    sharing device blocks by residue; one has its kept layers pushed down halfway; each is exact.
    stage=True: host-resident layers are staged into a per-layer buffer (the CUDA path) on the CPU."""
    model, oracle = models(family)
    layers = model.config.num_hidden_layers
    store = layered_store(make_store, model)
    store.layered.stage = stage
    factors = [0, 1, 2, 3, layers]
    sids = [f"f{f}" for f in factors]
    prompts = {sid: prompt(i, 37 + 23 * i) for i, sid in enumerate(sids)}
    want = {sid: expected(oracle, p, 8) for sid, p in prompts.items()}
    got = {sid: [] for sid in sids}
    leases = [store.lease(store.open(sid).session_id) for sid in sids]
    for lease in leases:
        lease.__enter__()
    factor = dict(zip(sids, factors))
    done = {sid: 0 for sid in sids}
    while any(len(g) < 8 for g in got.values()):
        entries, order = [], []
        for sid in sids:
            p = prompts[sid]
            if done[sid] < len(p):
                n = min(24, len(p) - done[sid])
                entries.append((sid, p[done[sid]:done[sid] + n], list(range(done[sid], done[sid] + n))))
            elif len(got[sid]) < 8:
                entries.append((sid, [got[sid][-1]], [len(p) + len(got[sid]) - 1]))
            else:
                continue
            order.append(sid)
        step = store.plan_step(entries, factors=[factor[sid] for sid in order])
        logits = run_step(model, step, step.last_rows())
        store.commit(step)
        store.check_integrity()
        for sid, row in zip(order, logits.argmax(-1).tolist()):
            if done[sid] < len(prompts[sid]):
                done[sid] += len(entries[order.index(sid)][1])
                if done[sid] < len(prompts[sid]):
                    continue
            got[sid].append(row)
        if len(got["f2"]) == 4 and factor["f2"] == 2:        # push f2's kept layers down mid-decode
            assert store.offload_layers("f2") > 0
            factor["f2"] = 0
            assert all(c.residue_block is None for c in store.session("f2").chunks)
    states = {sid: {c.state for c in store.session(sid).chunks} for sid in sids}
    assert states["f1"] == {ChunkState.DEVICE} and states["f3"] == {ChunkState.LAYERED}
    assert store.tiers.residues.blocks, "factors >= 2 were meant to split device blocks by residue"
    for lease in leases:
        lease.__exit__(None, None, None)
    for sid in sids:
        assert got[sid] == want[sid], sid
    assert not store.tiers.residues.blocks and store.stats().layered_tokens == 0       # turns ended: HOST now
    # next turn of a formerly layered session, plain (all layers swapped in from the host): still exact
    p2 = prompts["f3"] + got["f3"] + prompt(99, 10)
    out = greedy(model, torch.tensor([p2]), 6, cache=store.cache("f3"))
    assert out[0, len(p2):].tolist() == expected(oracle, p2, 6)


# ---- the engine ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, stage", [("llama", None), ("opt", None), ("llama", True)])
def test_prompts_longer_than_the_device_pool(family, stage, make_store):
    """256 device tokens: a 400-token prompt is refused without layerwise_kv; with it, prompts up to
    700 tokens run concurrently and every answer equals stateless generate (stage=True: through the
    staging path CUDA takes: copies ahead, host rows written at commit)."""
    model, oracle = models(family)
    plain = Engine(model, store=make_store(model, 256, chunk_size=16, cost_profile=PROFILE), max_batch_tokens=128)
    out = plain.generate(["a"], [prompt(0, 400)], SamplingParams(max_new_tokens=4))[0]
    assert out.finish_reason == "error" and isinstance(out.error, CapacityError)
    store = layered_store(make_store, model)
    store.layered.stage = stage
    engine = Engine(model, store=store, max_batch_tokens=128, layerwise_kv=True)
    lens = [400, 90, 300, 700, 50, 250]
    prompts = [prompt(i, n) for i, n in enumerate(lens)]
    outs = engine.generate([f"s{i}" for i in range(len(lens))], prompts, SamplingParams(max_new_tokens=10))
    for p, o in zip(prompts, outs):
        assert o.error is None and list(o.token_ids) == expected(oracle, p, 10), len(p)
    st_ = engine.stats()
    assert st_.layered_admissions >= 3 and st_.finished_requests == len(lens)
    engine.store.check_integrity()


def test_layerwise_engine_admits_what_a_plain_one_queues(make_store):
    """With room for one prompt's layers at a time, the plain engine runs the long prompts one after
    another; the layer-wise one admits them together (fewer steps to the last first token), exact."""
    model, oracle = models("llama")
    prompts = [prompt(10 + i, 200) for i in range(3)]
    first = {}
    for lw in (False, True):
        store = layered_store(make_store, model, device=288) if lw else \
            make_store(model, 288, chunk_size=16, cost_profile=PROFILE)
        engine = Engine(model, store=store, max_batch_tokens=256, layerwise_kv=lw, reserve_fraction=0.0)
        outs = engine.generate(["a", "b", "c"], prompts, SamplingParams(max_new_tokens=6))
        for p, o in zip(prompts, outs):
            assert list(o.token_ids) == expected(oracle, p, 6)
        firsts = {sid: min(rec.index for rec in engine.steps for e in rec.entries if e[0] == sid and e[3])
                  for sid in "abc"}
        first[lw] = max(firsts.values()), engine.stats()
    assert first[True][1].layered_admissions >= 1 and first[False][1].layered_admissions == 0
    assert first[True][0] < first[False][0], first      # the last first token comes steps earlier


def test_projection_pushes_kept_layers_down_and_stays_exact(make_store):
    """Long decodes of layered requests on a tiny pool: eq. 5 projects a shortfall, kept layers are
    pushed down (pushed_blocks > 0), outputs stay exact."""
    model, oracle = models("llama")
    engine = Engine(model, store=layered_store(make_store, model, device=160), max_batch_tokens=128,
                    layerwise_kv=True)
    prompts = [prompt(30 + i, 70 + 20 * i) for i in range(4)]
    outs = engine.generate([f"p{i}" for i in range(4)], prompts, SamplingParams(max_new_tokens=40))
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == expected(oracle, p, 40)
    assert engine.stats().pushed_blocks > 0


def test_x_min_and_factor_choice():
    # 8 layers, 1000 B per layer-token, 1e6 B/s: offloading one layer of 100 tokens takes beta * 0.1 s
    prof = CostProfile((16, 1024), (0.1, 0.1))          # 0.1 s per chunk of 16 -> 100 tokens = 7 chunks = 0.7 s
    lw = LayerwisePolicy(8, 1000, 1e6, prof, 16, beta=1.0)
    assert lw.prefill_seconds(100) == pytest.approx(0.7)
    assert lw.x_min(100) == 8 - 7                        # 7 layers' offload hides behind 0.7 s
    assert lw.factors(1) == [1, 2, 3, 4, 5, 6, 7, 8] and lw.factors(3) == [1, 2] and lw.factors(0)[-1] == 0
    blocks = lambda f, n: n if f == 1 else (0 if f == 0 else -(-n // f))
    assert lw.choose(10, 10, 1, blocks) == 1 and lw.choose(10, 4, 1, blocks) == 3
    assert lw.choose(10, 0, 3, blocks) is None and lw.choose(10, 0, 0, blocks) == 0
    assert LayerwisePolicy(8, 1000, 1e6, prof, 16, min_kept_layers=5).x_min(100) == 5


# ---- bad configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("x", [7, -1, True, 2.0])
def test_min_kept_layers_out_of_range(x, make_store):
    model, _ = models("llama")
    with pytest.raises(ValueError, match="min_kept_layers"):
        Engine(model, store=layered_store(make_store, model), layerwise_kv=True, min_kept_layers=x)


def test_layerwise_configuration_errors(make_store):
    model, _ = models("llama")
    with pytest.raises(ValueError, match="host tier"):
        Engine(model, device_capacity=256, layerwise_kv=True)
    with pytest.raises(ValueError, match="min_kept_layers needs layerwise_kv"):
        Engine(model, device_capacity=256, min_kept_layers=2)
    plain = make_store(model, 256, chunk_size=16, host_capacity=512, cost_profile=PROFILE)
    with pytest.raises(ValueError, match="made with layerwise_kv"):
        Engine(model, store=plain, layerwise_kv=True)
    with pytest.raises(ValueError, match="layout='paged'"):
        make_store(model, 256, host_capacity=512, cost_profile=PROFILE, layerwise_kv=True, layout="virtual",
                   max_context=128)
    with pytest.raises(ValueError, match="hidden states"):
        make_store(model, 256, host_capacity=512, cost_profile=PROFILE, layerwise_kv=True, hidden_states="always",
                   hidden_layers=1)
    spec = KVSpec(6, 2, 16, block_size=16)
    with pytest.raises(ValueError, match="attn_backend='torch'"):
        KVStore(spec, 256, host_capacity=512, attn_backend="flashinfer", layerwise_kv=True)
    plain.open("a")
    with pytest.raises(ValueError, match="layerwise_kv=True"):
        plain.plan_step([("a", [5, 6], [0, 1])], factors=[2])
    store = layered_store(make_store, model)
    store.open("a")
    for bad in (7, -1):
        with pytest.raises(ValueError, match="keep factor"):
            store.plan_step([("a", [5, 6], [0, 1])], factors=[bad])
    assert store.session("a").num_tokens == 0
