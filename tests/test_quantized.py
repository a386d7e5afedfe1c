"""Quantized models as transformers loads them (torchao through `TorchAoConfig`; stateful_hf/kernels/quantization.py,
docs/cpu.md#quantized-models): int8 weight-only and int8 dynamic-activation models run in the store, the engine
and the compiled step, exact against stateless generate on the same quantized model; prepacking and the invariant
GEMM's packed copies leave quantized weights alone; a store of a model with int8 activations is batch-invariant
by default (its per-row rounding turns a 1-ulp batch difference into a token); the disk tier's fingerprint tells a
quantized model from its float original."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Conversation, engine_round, store_turn

import stateful_hf
from stateful_hf import Engine
from stateful_hf.cache import CostProfile
from stateful_hf.kernels.quantization import detect
from stateful_hf.models import SCHEMES, quantize
from stateful_hf.testing import tiny_llama, tiny_opt

if os.environ.get("CI") == "true":
    import torchao  # noqa: F401  (CI installs the quant extra: a missing torchao fails instead of skipping)
else:
    pytest.importorskip("torchao", reason="the quant extra (torchao) is not installed")

BUILD = {"llama": lambda: tiny_llama("llama", seed=3), "qwen2": lambda: tiny_llama("qwen2", seed=3),
         "opt": lambda: tiny_opt(seed=3)}
PROFILE = CostProfile((16, 4096), (0.01, 0.05))   # these tests are not about eviction costs: none measured


def pair(family: str, scheme: str):
    """(model, oracle): two copies of one quantized tiny model (quantization is deterministic)."""
    return quantize(BUILD[family]().eval(), scheme), quantize(BUILD[family]().eval(), scheme)


def convs(n: int = 3) -> dict[str, Conversation]:
    return {f"q{i}": Conversation(seed=40 + i, first=21 + 13 * i, turn=8) for i in range(n)}


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_int8_weight_only_engine_is_exact_with_tier_moves(family, make_store):
    """Three sessions x three turns through the engine on a device tier too small for all of them (host swaps):
    every reply equals stateless greedy generate on the same quantized model; the quantized layers are not
    packed (prepack_weights="on" packs the float LM head alone) and stats() says what the model is."""
    model, oracle = pair(family, "int8-weight-only")
    q = detect(model)
    assert q is not None and not q.dynamic_activations and q.kind == "Int8Tensor"
    assert detect(BUILD[family]()) is None                                 # control: the float model
    store = make_store(model, device_capacity=96, host_capacity=4096, chunk_size=16, cost_profile=PROFILE)
    assert store.invariant_split is None and "float32" in store.invariant_off
    with Engine(model, store=store, prepack_weights="on", max_batch_tokens=48) as engine:
        cs = convs()
        for _ in range(3):
            engine_round(engine, cs, oracle, n=6)
        packed = engine.runner.packed
        stats = engine.stats()
    assert [f.module is model.get_output_embeddings() for f in packed.forwards] == [True]
    assert stats.quantization == q.describe() and str(q.layers) in stats.quantization
    assert store.stats().counters.swapped_in_host > 0                   # the tier moves happened


def test_int8_dynamic_store_is_batch_invariant_by_default(make_store):
    """int8 activations with per-token scales: each row is rounded at its own scale, so the batch a row ran in
    can move a rounding (stock float kernels sum in batch-dependent orders). Such a float32 store is
    batch-invariant by default (a weight-only one is not: control), and the engine's tokens equal stateless
    generate under `batch_invariant()` on the same quantized model, whatever the batch mix."""
    model, oracle = pair("llama", "int8-dynamic")
    assert detect(model).dynamic_activations
    store = make_store(model, device_capacity=2048, chunk_size=16, cost_profile=PROFILE)
    assert store.invariant_split == 16 and store.invariant_off is None
    weight_only = quantize(tiny_llama(seed=3), "int8-weight-only")
    off = make_store(weight_only, device_capacity=256, chunk_size=16, cost_profile=PROFILE)
    assert off.invariant_split is None
    with Engine(model, store=store, max_batch_tokens=40) as engine, stateful_hf.batch_invariant(16):
        cs = convs(4)
        for _ in range(3):
            engine_round(engine, cs, oracle, n=6)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_store_turns_through_generate_are_exact(scheme, make_store):
    """The transformers seam: `generate(past_key_values=store.cache(sid))` on a quantized model, with the
    session's chunks moved to the host and back between turns, equals stateless generate."""
    model, oracle = pair("qwen2", scheme)
    store = make_store(model, device_capacity=512, host_capacity=1024, chunk_size=16, cost_profile=PROFILE)
    ctx = stateful_hf.batch_invariant(16) if store.invariant_split else torch.no_grad()
    conv = Conversation(seed=5, first=37)
    with ctx:
        for _ in range(3):
            out = store_turn(model, oracle, store, "s", conv.ids, n=6)
            conv.reply(out)
            store.move("s", range(len(store.session("s").chunks)), "host")
    assert store.stats("s").last_turn.reused_tokens > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_quantized_step_compiles_fullgraph_and_is_exact(scheme, make_store):
    """Dynamo alone, fullgraph (as tests/test_compiled_step.py): the steps of a quantized model trace through
    torchao's weight subclass with no graph break. Weight-only: the tokens equal stateless generate. int8
    activations (compile stays off under batch invariance, so this store runs stock kernels): the tokens equal
    the same engine's run eager, step for step (the oracle for stock kernels is the invariant store above)."""
    from test_compiled_step import dynamo_engine

    from stateful_hf import SamplingParams
    from stateful_hf.integration.compiled_step import GraphMode

    model, oracle = pair("llama", scheme)
    store = make_store(model, device_capacity=2048, chunk_size=16, cost_profile=PROFILE, batch_invariant=False)
    cs = convs(2)
    with dynamo_engine(model, store, max_batch_tokens=40) as engine:
        if scheme == "int8-weight-only":
            for _ in range(2):
                engine_round(engine, cs, oracle, n=5)
        else:
            prompts = [c.ids[0].tolist() for c in cs.values()]
            got = [o.token_ids for o in engine.generate(list(cs), prompts, SamplingParams(max_new_tokens=5))]
        compiled = engine.runner.compiled
    assert compiled.failed == {} and compiled.steps > 0, compiled.failed
    # torchao's dynamic activation quantization branches on the token count: not one unbacked graph, but guarded
    assert compiled.mode is (GraphMode.GUARDED if scheme == "int8-dynamic" else GraphMode.ONE), compiled.guarded_because
    if scheme == "int8-dynamic":
        eager_store = make_store(oracle, device_capacity=2048, chunk_size=16, cost_profile=PROFILE,
                                 batch_invariant=False)
        with Engine(oracle, store=eager_store, max_batch_tokens=40) as eager:
            want = [o.token_ids for o in eager.generate(list(cs), prompts, SamplingParams(max_new_tokens=5))]
        assert got == want


def test_fingerprint_tells_the_quantized_model_from_its_float_original():
    """The disk tier keys saved KV by the model's fingerprint: a quantized copy has its own (its int8 data and
    scales are sampled), two quantizations of one model agree, and a plain model's fingerprint is unchanged."""
    from stateful_hf.fingerprint import model_fingerprint

    plain = model_fingerprint(tiny_llama(seed=3))
    wo = model_fingerprint(quantize(tiny_llama(seed=3), "int8-weight-only"))
    dyn = model_fingerprint(quantize(tiny_llama(seed=3), "int8-dynamic"))
    assert wo == model_fingerprint(quantize(tiny_llama(seed=3), "int8-weight-only"))
    assert len({plain, wo, dyn}) == 3
    assert plain == model_fingerprint(tiny_llama(seed=3))


def test_cost_profile_key_names_the_quantization():
    """A measured cost profile is cached per model: a quantized copy (its config unchanged by `quantize_`) gets a
    key of its own per scheme, and a plain model's key is the same with or without this rule (the control: two
    plain copies agree, so the difference comes from the weights' kind, not from the seed or the call)."""
    from stateful_hf.cache import KVSpec
    from stateful_hf.profile.cost import _key

    spec = KVSpec(2, 2, 16, block_size=16)                # the key reads the spec, never the model through it
    plain = _key(tiny_llama(seed=3), spec)
    assert plain == _key(tiny_llama(seed=3), spec)
    keys = {_key(quantize(tiny_llama(seed=3), s), spec) for s in SCHEMES}
    assert len(keys) == len(SCHEMES) and plain not in keys


def test_load_names_the_schemes():
    """`models.load(quantization=...)` (the server's and the demo's `--quantization`): a scheme by name;
    another name is a ValueError naming the schemes, raised before any model is loaded."""
    from stateful_hf.models import load
    from stateful_hf.serve.flags import QUANTIZATIONS

    assert QUANTIZATIONS == SCHEMES
    model, _ = load("tiny-random", quantization="int8-dynamic")
    assert detect(model).dynamic_activations and detect(load("tiny-random")[0]) is None

    with pytest.raises(ValueError, match="int8-weight-only, int8-dynamic"):
        load("no-such-model", quantization="int4")
