"""The new families through the Triton kernel (interpreted on the CPU): Gemma 2 (softcap, a sliding
and a global layer, query_pre_attn_scalar) and Gemma 3 (per-layer windows, QK-norm) stay token-exact
in generate (a recomputed prefix too) and in the engine. Phi-3's one window on every layer is the
kernel's plain window path (test_kernels_triton); interpreted Triton is slow, so two families here.
On a CUDA machine the models move to the GPU and the kernel compiles for real (these tests are then
also marked `cuda`, so `pytest -m cuda` and gpu_check run them)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Conversation, engine_round, greedy

from stateful_hf import Engine
from stateful_hf.cache import CostProfile
from stateful_hf.testing import TINY_FAMILIES

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the first Triton launch (the kernel is built then)
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
HEADS = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64)   # a head size the kernel takes


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_generate_and_engine_exact_with_triton(family, make_store):
    make = TINY_FAMILIES[family]
    model, oracle = make(**HEADS).to(DEVICE), make(**HEADS).to(DEVICE)
    store = make_store(model, device_capacity=512, attn_backend="triton", cost_profile=CostProfile())
    assert store.attn_backend == "triton"
    conv = Conversation(seed=5, first=40, turn=8)
    ids = conv.ids.to(DEVICE)
    out = greedy(model, ids, n=3, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, ids, n=3))
    conv.reply(out.cpu())
    store.move("a", [0], "dropped")                  # a recomputed prefix through the kernel
    ids = conv.ids.to(DEVICE)
    out = greedy(model, ids, n=3, cache=store.cache("a"))
    assert torch.equal(out, greedy(oracle, ids, n=3))
    convs = {f"s{i}": Conversation(seed=20 + i, first=15 + 9 * i, turn=6) for i in range(2)}
    with Engine(model, store=store, max_batch_tokens=64) as engine:
        engine_round(engine, convs, oracle, n=3)
