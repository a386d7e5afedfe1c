"""`model.generate` and the engine stay token-exact with the Triton kernel (interpreted on the CPU;
on a CUDA machine the models move to the GPU, the kernel compiles, and the tests are also `cuda`)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Conversation, engine_round, greedy

from stateful_hf.cache import CostProfile
from stateful_hf.testing import tiny_llama

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the first Triton launch (the kernel is built then)
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _model():
    # head_dim 64: one of the Triton kernel's head sizes
    return tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(DEVICE)


def test_generate_exact_with_triton_backend(make_store):
    model, oracle = _model(), _model()
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    assert store.attn_backend == "triton"
    cache = store.cache("a")
    conv = Conversation(seed=11, first=40, turn=8)
    for _ in range(2):
        ids = conv.ids.to(DEVICE)
        out = greedy(model, ids, n=5, cache=cache)
        assert torch.equal(out, greedy(oracle, ids, n=5))
        conv.reply(out.cpu())
    store.move("a", [0], "dropped")                   # a recomputed prefix through the Triton kernel too
    ids = conv.ids.to(DEVICE)
    out = greedy(model, ids, n=5, cache=cache)
    assert torch.equal(out, greedy(oracle, ids, n=5))


def test_unknown_backend_is_refused(make_store):
    with pytest.raises(ValueError, match="unknown paged attention backend"):
        make_store(tiny_llama(), attn_backend="magic", cost_profile=CostProfile())


def test_engine_exact_with_triton_backend(make_store):
    from stateful_hf import Engine

    model, oracle = _model(), _model()
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    convs = {f"s{i}": Conversation(seed=20 + i, first=15 + 9 * i, turn=6) for i in range(3)}
    with Engine(model, store=store, max_batch_tokens=64) as engine:
        for _ in range(2):
            engine_round(engine, convs, oracle, n=4)
