"""`model.generate` and the engine stay token-exact with the Triton kernel (interpreted on the CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before the first Triton launch

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import Conversation, engine_round, greedy  # noqa: E402

from stateful_hf.cache import CostProfile  # noqa: E402
from stateful_hf.testing import tiny_llama  # noqa: E402

pytest.importorskip("triton")


def test_generate_exact_with_triton_backend(make_store):
    # head_dim 64: one of the Triton kernel's head sizes
    model, oracle = (tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1) for _ in range(2))
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    assert store.attn_backend == "triton"
    cache = store.cache("a")
    conv = Conversation(seed=11, first=40, turn=8)
    for _ in range(3):
        out = greedy(model, conv.ids, n=5, cache=cache)
        assert torch.equal(out, greedy(oracle, conv.ids, n=5))
        conv.reply(out)
    store.move("a", [0], "dropped")                   # a recomputed prefix through the Triton kernel too
    out = greedy(model, conv.ids, n=5, cache=cache)
    assert torch.equal(out, greedy(oracle, conv.ids, n=5))


def test_unknown_backend_is_refused(make_store):
    with pytest.raises(ValueError, match="unknown paged attention backend"):
        make_store(tiny_llama(), attn_backend="magic", cost_profile=CostProfile())


def test_engine_exact_with_triton_backend(make_store):
    from stateful_hf import Engine

    model, oracle = (tiny_llama(hidden_size=128, num_attention_heads=2, num_key_value_heads=1) for _ in range(2))
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    convs = {f"s{i}": Conversation(seed=20 + i, first=15 + 9 * i, turn=6) for i in range(3)}
    with Engine(model, store=store, max_batch_tokens=64) as engine:
        for _ in range(2):
            engine_round(engine, convs, oracle, n=4)
