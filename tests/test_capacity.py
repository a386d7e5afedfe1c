"""What a step could get (`Capacity`, stateful_hf/cache/pools/tier_pools.py): `room().device_blocks` /
`available_host_blocks` against a reference computed from the chunk tables alone (a chunk object
held by several sessions is one block, and counts only when every session holding it is idle), with
shared prefixes, busy holders and chunks moved to the host. Exactness of the turns is checked
against stateless greedy generate."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import FAMILIES, greedy

from stateful_hf.cache import ChunkState

BS = 8
SYSTEM = torch.randint(3, 300, (1, 43), generator=torch.Generator().manual_seed(11))   # 5 full chunks + 3


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


def reference(store, states, shadows: bool) -> int:
    """Blocks of chunks in `states` (or cached on the device, with `shadows`) whose every holder is
    idle, each physical chunk once: holders found by identity across every session's table."""
    holders: dict[int, list] = {}
    chunks: dict[int, object] = {}
    for s in store.sessions:
        for c in s.chunks:
            holders.setdefault(id(c), []).append(s)
            chunks[id(c)] = c
    return sum(1 for i, c in chunks.items()
               if (c.state in states or (shadows and c.shadow is not None))
               and not any(h.busy for h in holders[i]))


def check(store) -> None:
    store.check_integrity()
    assert store.room().device_blocks == store.free_blocks() + reference(store, {ChunkState.DEVICE}, True)
    assert store.available_host_blocks() == store.tiers.host.num_free + reference(store, {ChunkState.HOST}, False)


@pytest.fixture
def models():
    return FAMILIES["llama"](), FAMILIES["llama"]()


def test_available_blocks_count_a_shared_chunk_once_and_only_with_every_holder_idle(models, make_store):
    model, oracle = models
    store = make_store(model, device_capacity=1024, host_capacity=1024, chunk_size=BS)
    for i, sid in enumerate("abc"):
        ids = torch.cat([SYSTEM, user(i)], 1)
        assert torch.equal(greedy(model, ids, cache=store.cache(sid)), greedy(oracle, ids))
    assert store.stats().shared_tokens == 40        # the 5 full chunks of the system prompt, held by a, b, c
    check(store)
    idle_all = store.room().device_blocks
    with store.lease("a"):                         # a busy holder: the shared chunks do not count
        check(store)
        own_a = len(store.session("a").chunks) - 5
        assert store.room().device_blocks == idle_all - own_a - 5
        with store.lease("b"):
            check(store)
    check(store)
    assert store.room().device_blocks == idle_all
    store.move("c", range(5, len(store.session("c").chunks)), "host")   # c's own chunks; the shared stay
    check(store)
    with store.lease("c"):                         # c's host chunks are busy, the shared ones too
        check(store)
        assert store.available_host_blocks() == store.tiers.host.num_free
    store.move("a", range(len(store.session("a").chunks)), "host")     # a shared chunk moves for all holders
    check(store)
    with contextlib.ExitStack() as stack:
        for sid in "abc":
            stack.enter_context(store.lease(sid))
        check(store)
        assert store.room().device_blocks == store.free_blocks()
    ids = torch.cat([SYSTEM, user(1), user(9)], 1)                       # b continues, exactly
    assert torch.equal(greedy(model, ids, cache=store.cache("b")), greedy(oracle, ids))
    check(store)
