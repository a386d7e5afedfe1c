"""Synchronous block copies (`transfer.copy_now`, `HiddenPool.copy_slots`) slice runs of consecutive
ids instead of gathering: for any ids they write exactly what the per-layer gather wrote, and
nothing else."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stateful_hf.cache.hidden.states import HiddenPool, HiddenSpec
from stateful_hf.cache.movement.transfer import copy_now
from stateful_hf.cache.pools.pool import BlockPool, block_runs
from stateful_hf.cache.spec import KVSpec

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4)
N = 12


def _ids(draw, n: int) -> list[int]:
    return draw(st.permutations(range(N)))[:n]


@st.composite
def id_pairs(draw) -> tuple[list[int], list[int]]:
    n = draw(st.integers(0, N))
    runs = draw(st.booleans())          # favour long runs half the time
    if runs:
        s0, d0 = draw(st.integers(0, N - n)), draw(st.integers(0, N - n))
        return list(range(s0, s0 + n)), list(range(d0, d0 + n))
    return _ids(draw, n), _ids(draw, n)


def test_block_runs():
    assert block_runs([], []) == []
    assert block_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert block_runs([1, 2, 3], [7, 5, 6]) == [(1, 7, 1), (2, 5, 2)]


@settings(max_examples=60, deadline=None)
@given(id_pairs())
def test_copy_now_matches_the_gather(pair):
    src_ids, dst_ids = pair
    src, dst = BlockPool(SPEC, N), BlockPool(SPEC, N)
    src.data.copy_(torch.randn(src.data.shape))
    dst.data.copy_(torch.randn(dst.data.shape))
    want = dst.data.clone()
    if src_ids:
        s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
        for layer in range(SPEC.num_layers):
            want[layer].index_copy_(0, d, src.data[layer].index_select(0, s))
    copy_now(src, src_ids, dst, dst_ids)
    assert torch.equal(dst.data, want)


@settings(max_examples=40, deadline=None)
@given(id_pairs())
def test_hidden_copy_slots_matches_the_gather(pair):
    src_ids, dst_ids = pair
    spec = HiddenSpec(SPEC, hidden_size=8, hidden_layers=2)
    src, dst = HiddenPool(spec, N), HiddenPool(spec, N)
    for t in (src.hidden, src.kv, dst.hidden, dst.kv):
        t.copy_(torch.randn(t.shape))
    want = [dst.hidden.clone(), dst.kv.clone()]
    if src_ids:
        s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
        for w, a in zip(want, (src.hidden, src.kv), strict=True):
            w.index_copy_(1, d, a.index_select(1, s))
    src.copy_slots(src_ids, dst, dst_ids)
    assert torch.equal(dst.hidden, want[0]) and torch.equal(dst.kv, want[1])
