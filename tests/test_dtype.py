"""`--dtype auto` picks by capability (`stateful_hf.dtypes.resolve_dtype`): the dispatch with CPU flags
built by hand (AMX without AVX512-BF16, AVX512-BF16 without AMX as on an AMD Zen 4, neither), a faked
CUDA GPU, explicit names, the emulated-bf16 warning, and this machine's own CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from stateful_hf import dtypes, models
from stateful_hf.dtypes import resolve_dtype
from stateful_hf.kernels.cpu_features import CpuFeatures

AMX_ONLY = CpuFeatures(avx512=True, avx512_bf16=False, amx_bf16=True, mkl=True, onednn=True)
ZEN4 = CpuFeatures(avx512=True, avx512_bf16=True, amx_bf16=False, mkl=False, onednn=True)
NO_UNITS = CpuFeatures(avx512=True, avx512_bf16=False, amx_bf16=False, mkl=True, onednn=True)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a new process would: no CPU warned about yet."""
    monkeypatch.setattr(dtypes, "_warned", set())


@pytest.mark.parametrize(("features", "want"), [(AMX_ONLY, torch.bfloat16), (ZEN4, torch.bfloat16),
                                                (NO_UNITS, torch.float32)], ids=["amx-only", "zen4", "none"])
def test_auto_picks_by_the_cpus_bf16_units(features, want):
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # auto never warns
        dtype, reason = resolve_dtype("auto", "cpu", features)
    assert dtype == want
    units = "has bf16 units" if want == torch.bfloat16 else "has no bf16 units"
    assert reason == f"this CPU {units}: {features.describe()}"
    assert resolve_dtype("AUTO", torch.device("cpu"), features)[0] == want


def test_bfloat16_without_bf16_units_warns_once_and_still_loads_bfloat16():
    with pytest.warns(UserWarning, match=r"emulated, slower than float32") as seen:
        dtype, reason = resolve_dtype("bfloat16", "cpu", NO_UNITS)
    assert dtype == torch.bfloat16 and "emulated" in reason
    assert NO_UNITS.describe() in str(seen[0].message)          # names the CPU's features
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype(torch.bfloat16, "cpu", NO_UNITS)[0] == torch.bfloat16     # once per process
        for features in (AMX_ONLY, ZEN4):                                                # units: no warning
            assert resolve_dtype("bf16", "cpu", features) == (torch.bfloat16, "asked for")


def test_explicit_names_and_torch_dtypes_pass_through():
    for name, want in (("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32),
                       ("bf16", torch.bfloat16), ("float16", torch.float16), ("half", torch.float16),
                       (torch.float16, torch.float16), (torch.float32, torch.float32)):
        for features in (AMX_ONLY, ZEN4):
            assert resolve_dtype(name, "cpu", features) == (want, "asked for"), name
        assert resolve_dtype(name, "cuda")[0] == want         # a named dtype asks nothing of the GPU


@pytest.mark.parametrize("name", ["bf17", "int8", "", None, 32])
def test_an_unknown_name_is_a_value_error_naming_the_choices(name):
    with pytest.raises(ValueError, match=r"unknown dtype .*; choose from auto, float32, fp32, float, bfloat16"):
        resolve_dtype(name, "cpu", NO_UNITS)


def test_auto_on_cuda_asks_the_gpu(monkeypatch):
    monkeypatch.setattr(dtypes, "_cuda_bf16", lambda dev: (True, "NVIDIA H100"))
    assert resolve_dtype("auto", "cuda:0") == (torch.bfloat16, "this GPU computes bf16 natively: NVIDIA H100")
    monkeypatch.setattr(dtypes, "_cuda_bf16", lambda dev: (False, "Tesla T4"))
    assert resolve_dtype("auto", "cuda") == (torch.float32, "this GPU has no native bf16: Tesla T4")
    dtype, reason = resolve_dtype("auto", "mps")
    assert dtype == torch.float32 and "mps" in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_auto_on_this_gpu():
    native = torch.cuda.get_device_capability()[0] >= 8
    assert resolve_dtype("auto", "cuda")[0] == (torch.bfloat16 if native else torch.float32)


def test_auto_on_this_cpu_follows_its_flags():
    """On this machine (AVX-512 and VNNI, neither AVX512-BF16 nor AMX) auto is float32; on a machine
    whose /proc/cpuinfo lists either, bfloat16."""
    try:                                    # read here, apart from CpuFeatures.detect
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    units = bool({"avx512_bf16", "amx_bf16"} & flags)
    features = CpuFeatures.detect()
    assert features.bf16_units == units, (features, sorted(f for f in flags if "avx512" in f or "amx" in f))
    dtype, reason = resolve_dtype("auto")
    assert dtype == (torch.bfloat16 if units else torch.float32)
    assert features.describe() in reason


def test_load_takes_auto_and_says_nothing(capsys):
    model, _ = models.load(models.TINY_MODEL, dtype="auto")
    assert next(model.parameters()).dtype == resolve_dtype("auto")[0]
    model, _ = models.load(models.TINY_MODEL, dtype="fp32")
    assert next(model.parameters()).dtype == torch.float32
    assert capsys.readouterr() == ("", "")
