"""A step that rebuilds chunks from hidden states but cannot get every block it needs leaves no chunk
half-rebuilt. Token output is checked against stateless greedy generate, and the store's integrity
after every turn. (A turn that adopts chunks another step is rebuilding: tests/test_prefix_reuse.py.)"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import FAMILIES, greedy, store_turn

import stateful_hf
from stateful_hf.cache import CapacityError, CostProfile

BS = 8


def user(seed: int, n: int = 9) -> torch.Tensor:
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(2000 + seed))


exact = partial(store_turn, n=5)    # one exact turn of a session, integrity checked after it


def test_a_step_that_cannot_get_its_blocks_leaves_no_unrebuilt_chunk():
    """A turn whose chunks are hidden states needs blocks for their rebuild and for its new tokens;
    another session is busy (leased: its blocks cannot be taken), so the rebuild's blocks are found
    and the new tokens' are not: plan_step raises CapacityError, and the chunks queued for the rebuild
    go back to their hidden form. Left DEVICE (with a `source`) in blocks that never got their K/V,
    they would be read by the next turn as the session's KV: wrong tokens."""
    model, oracle = FAMILIES["opt"](), FAMILIES["opt"]()
    store = stateful_hf.SessionStore(model, device_capacity=10 * BS, host_capacity=40 * BS, chunk_size=BS,
                                     cost_profile=CostProfile(), hidden_states="always", hidden_layers=1)
    exact(model, oracle, store, "b", user(10, 36), n=4)
    h = exact(model, oracle, store, "h", user(11, 20), n=4)
    store.move("h", range(len(store.session("h").chunks)), "hidden")
    pool = store.tiers.device
    free = torch.tensor(pool.free_ids())
    pool.data[:, free] = torch.randn_like(pool.data[:, free])      # free blocks hold anything
    nxt = torch.cat([h, user(12, 30)], 1)
    with store.lease("b"):
        with pytest.raises(CapacityError):
            greedy(model, nxt, n=3, cache=store.cache("h"))
        assert all(c.state.value == "hidden" and c.source is None for c in store.session("h").chunks)
        store.check_integrity()
    exact(model, oracle, store, "h", nxt, n=3)
    assert store.stats("h").last_turn.restored_hidden == h.shape[1] - 1
    store.close()
