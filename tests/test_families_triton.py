"""The new families through the Triton kernel (interpreted on the CPU): Gemma 2 (softcap, a sliding
and a global layer, query_pre_attn_scalar) and Gemma 3 (per-layer windows, QK-norm) stay token-exact
in generate (a recomputed prefix too) and in the engine. Phi-3's one window on every layer is the
kernel's plain window path (test_kernels_triton); interpreted Triton is slow, so two families here."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before the first Triton launch

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import Conversation, engine_round, greedy  # noqa: E402

from stateful_hf import Engine  # noqa: E402
from stateful_hf.cache import CostProfile  # noqa: E402
from stateful_hf.testing import TINY_FAMILIES  # noqa: E402

pytest.importorskip("triton")
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)   # a head size the kernel takes


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_generate_and_engine_exact_with_triton(family, make_store):
    make = TINY_FAMILIES[family]
    model, oracle = make(**HEADS), make(**HEADS)
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    assert store.attn_backend == "triton"
    conv = Conversation(seed=5, first=40, turn=8)
    out = greedy(model, conv.ids, n=3, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, conv.ids, n=3))
    conv.reply(out)
    store.move("a", [0], "dropped")                  # a recomputed prefix through the kernel
    out = greedy(model, conv.ids, n=3, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, conv.ids, n=3))
    convs = {f"s{i}": Conversation(seed=20 + i, first=15 + 9 * i, turn=6) for i in range(2)}
    with Engine(model, store=store, max_batch_tokens=64) as engine:
        engine_round(engine, convs, oracle, n=3)
