"""Bad arguments get clear errors (named argument, what was given, what is expected), never raw
internals, and lose nothing: store.move's chunk list, capacities beyond any tensor or this machine,
and the server's 409 text."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import greedy

import stateful_hf
from stateful_hf.cache import SessionBusyError, StoreError
from stateful_hf.testing import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("chunks, message", [
    (["a"], "chunk indices must be ints, got 'a' (str)"),
    ([1.0], "chunk indices must be ints, got 1.0 (float)"),
    ([True], "chunk indices must be ints, got True (bool)"),
    (None, "chunks must be an iterable of chunk indices (ints), got None"),
    ("0", "chunks must be an iterable"),
    (3, "chunks must be an iterable"),
])
def test_move_with_bad_chunks_is_a_clear_type_error_and_changes_nothing(model, chunks, message, make_store):
    store = make_store(model, 256, chunk_size=16, host_capacity=256)
    x = torch.arange(3, 43).unsqueeze(0)
    greedy(model, x, 4, cache=store.cache("a"))
    before = store.residency("a")
    with pytest.raises(TypeError) as e:
        store.move("a", chunks, "host")
    assert message in str(e.value)
    assert store.residency("a") == before
    store.move("a", [np.int64(0), torch.tensor(1)], "host")       # numpy / torch integers are indices
    assert store.residency("a")["host"] == 32


@pytest.mark.parametrize("capacity", ["999999999TiB", "8000000 PiB", 10**30])
def test_capacity_beyond_any_tensor_is_a_clear_value_error(model, capacity):
    for kw in ({"device_capacity": capacity}, {"device_capacity": 256, "host_capacity": capacity}):
        with pytest.raises(ValueError, match="more than one pool tensor can address"):
            stateful_hf.SessionStore(model, **kw)


def test_a_pool_torch_cannot_allocate_is_a_store_error(model, monkeypatch):
    """No test allocates a huge pool on a shared machine: torch's out-of-memory is simulated."""
    import stateful_hf.cache.store_parts as store_parts  # where `open_pools` makes the pools

    def refuse(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(store_parts, "BlockPool", refuse)
    with pytest.raises(StoreError, match=r"pool for device_capacity='64GiB'.*give a smaller device_capacity"):
        stateful_hf.SessionStore(model, "64GiB")


def test_busy_409_names_the_session_once():
    pytest.importorskip("fastapi")                 # the server (stateful_hf.serve) imports the web stack
    from stateful_hf.serve.replica import api_error

    err = api_error(SessionBusyError("d1"))
    assert err.status == 409 and err.code == "session_busy"
    assert err.message == "session 'd1' has a turn in flight; retry when it has finished"
