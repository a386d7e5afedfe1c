"""Packed linear weights (kernels/linear.py): the kernel is chosen by what the CPU
has, the engine's steps use it and stay exact against stateless generate, every other call of the model
is untouched, and a weight changed after packing is never read from a stale copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, Conversation, engine_round, greedy

from stateful_hf import Engine
from stateful_hf.kernels.cpu_features import CpuFeatures
from stateful_hf.kernels.linear import LinearKernel, PackedWeights, choose

CPU = torch.device("cpu")
AMX = CpuFeatures(avx512=True, avx512_bf16=True, amx_bf16=True, mkl=True, onednn=True)      # Sapphire Rapids
ZEN4 = CpuFeatures(avx512=True, avx512_bf16=True, amx_bf16=False, mkl=True, onednn=True)    # AVX512-BF16, no AMX
PLAIN = CpuFeatures(avx512=True, avx512_bf16=False, amx_bf16=False, mkl=True, onednn=True)  # no bf16 units
NO_MKL = CpuFeatures(avx512=False, avx512_bf16=False, amx_bf16=False, mkl=False, onednn=True)


def test_kernel_chosen_by_capability_not_vendor():
    assert choose(torch.float32, CPU, PLAIN) is LinearKernel.MKL_PACKED
    assert choose(torch.bfloat16, CPU, AMX) is LinearKernel.ONEDNN_PACKED
    assert choose(torch.bfloat16, CPU, ZEN4) is LinearKernel.ONEDNN_PACKED
    assert choose(torch.bfloat16, CPU, PLAIN) is LinearKernel.MKL_UPCAST     # emulated bf16: float32's sgemm
    assert choose(torch.float32, CPU, NO_MKL) is LinearKernel.STOCK
    assert choose(torch.bfloat16, CPU, NO_MKL) is LinearKernel.STOCK
    assert choose(torch.float16, CPU, AMX) is LinearKernel.STOCK
    assert choose(torch.float32, torch.device("cuda"), AMX) is LinearKernel.STOCK
    with pytest.raises(ValueError, match="prepack_weights=True: bfloat16 packing needs .* bf16 units .* MKL"):
        choose(torch.bfloat16, CPU, NO_MKL, required=True)
    with pytest.raises(ValueError, match="prepack_weights=True: prepacked weights are a CPU kernel"):
        choose(torch.float32, torch.device("cuda"), AMX, required=True)


def test_engine_option_on_without_a_kernel_names_it(monkeypatch):
    monkeypatch.setattr(CpuFeatures, "detect", staticmethod(lambda: NO_MKL))
    model = FAMILIES["llama"]().to(torch.bfloat16)
    with pytest.raises(ValueError, match="prepack_weights"):
        Engine(model, device_capacity=256, prepack_weights="on")
    with pytest.raises(ValueError, match="prepack_weights must be one of auto, on, off"):
        Engine(FAMILIES["llama"](), device_capacity=256, prepack_weights="yes")
    assert Engine(model, device_capacity=256, batch_invariant=False).runner.packed is None   # auto: stock here


@pytest.mark.parametrize("kernel", [LinearKernel.MKL_PACKED, LinearKernel.ONEDNN_PACKED, LinearKernel.MKL_UPCAST])
def test_packed_only_inside_active_and_follows_the_weight(kernel):
    here = CpuFeatures.detect()
    if choose(kernel.dtype, CPU, here) is not kernel:
        pytest.skip(f"this CPU ({here.describe()}) takes {choose(kernel.dtype, CPU, here)} for {kernel.dtype}")
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(kernel.dtype)
    holder = torch.nn.Sequential(lin)
    x = torch.randn(24, 64).to(kernel.dtype)
    packed = PackedWeights.install(holder, kernel, rows=32)
    assert PackedWeights.install(holder, kernel, rows=32) is packed                # idempotent
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))                  # outside: F.linear itself
    with packed.active():
        got = lin(x)
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))
    stale = packed.forwards[0].packed
    with torch.no_grad():
        lin.weight.mul_(2)                                                         # in place: a new version
    with packed.active():
        got = lin(x)
    assert packed.forwards[0].packed is not stale
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias))
    lin.weight = torch.nn.Parameter(torch.randn(96, 64).to(kernel.dtype))          # replaced
    with packed.active():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    # negative control: the stale copy would have answered differently
    from stateful_hf.kernels.linear import apply
    assert not torch.allclose(apply(x, stale, lin.weight, lin.bias, kernel), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_engine_on_packed_weights_exact(family):
    model, oracle = FAMILIES[family](), FAMILIES[family]()
    engine = Engine(model, device_capacity=512, chunk_size=16, max_batch_tokens=64, prepack_weights="on")
    assert engine.runner.packed is not None and engine.runner.packed.kernel is LinearKernel.MKL_PACKED
    assert engine.stats().linear == "mkl-packed (prepack_weights='on')"
    convs = {f"s{i}": Conversation(seed=300 + i, first=12 + 3 * i) for i in range(6)}
    for _ in range(2):                                                             # a first and a returning turn
        engine_round(engine, convs, oracle, 5)
        engine.store.check_integrity()
    # the model's other calls are untouched: a stateless generate on the packed model equals the oracle's
    x = convs["s0"].ids
    assert torch.equal(greedy(model, x, 4, attention_mask=torch.ones_like(x)),
                       greedy(oracle, x, 4, attention_mask=torch.ones_like(x)))


def test_engine_says_which_linear_kernel_its_steps_use():
    """`Engine.stats().linear` names the steps' linear kernel and the reason: off, or auto's measurement
    (packed or not, the trial's figures either way)."""
    model = FAMILIES["llama"]()
    assert Engine(model, device_capacity=512, prepack_weights="off").stats().linear == \
        "F.linear (prepack_weights='off')"
    auto = Engine(FAMILIES["llama"](), device_capacity=512).stats().linear     # prepack_weights="auto"
    assert "(auto: " in auto and "F.linear's speed" in auto, auto
