"""Which torch dtype a model loads in: `resolve_dtype(name, device, features)`.

"auto" is chosen by what the device can do, never by vendor: bfloat16 on a CPU with bf16 units
(AMX-BF16 or AVX512-BF16: a Sapphire Rapids Xeon, an AMD Zen 4/5), float32 on a CPU without them
(there oneDNN emulates bf16, slower than float32); on CUDA, bfloat16 where the GPU computes it natively
(`torch.cuda.is_bf16_supported`), else float32; float32 on any other device. An explicit name passes
through; bfloat16 on a CPU without bf16 units warns once that it is emulated.

Importing this module does not import torch (the server checks `--dtype`'s name, `NAMES`, before torch).
"""

from __future__ import annotations

import warnings

# vLLM's --dtype names -> torch's ("auto" stays "auto": `resolve_dtype`)
NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
         "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}

_warned: set = set()        # the CPUs (CpuFeatures) whose emulated bf16 has been warned about in this process


def canonical(name: str) -> str:
    """The torch name of a dtype name of NAMES, any case ("auto" stays "auto"); else ValueError."""
    torch_name = NAMES.get(name.lower()) if isinstance(name, str) else None
    if torch_name is None:
        raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(NAMES)} (or a torch.dtype)")
    return torch_name


def resolve_dtype(name, device="cpu", features=None):
    """(torch.dtype, reason): the dtype `name` loads on `device`, and why, in words for a start-up line.

    `name`: a name of NAMES ("auto", "float32", "bf16", ...) or a torch.dtype (passes through); anything
    else is a ValueError naming the choices. `features`: the CPU's `CpuFeatures` (default: this CPU's,
    `CpuFeatures.detect()`; tests pass flags built by hand). Prints and logs nothing; warns (once per
    process and CPU) when bfloat16 is asked for on a CPU without bf16 units."""
    import torch

    dev = torch.device(device)
    if isinstance(name, torch.dtype):
        dtype, auto = name, False
    else:
        torch_name = canonical(name)
        auto = torch_name == "auto"
        dtype = None if auto else getattr(torch, torch_name)
    if not auto:
        if dtype == torch.bfloat16 and dev.type == "cpu":
            features = _detect() if features is None else features
            if not features.bf16_units:
                if features not in _warned:
                    _warned.add(features)
                    warnings.warn(f"bfloat16 on a CPU without bf16 units (AMX-BF16 or AVX512-BF16; this CPU: "
                                  f"{features.describe()}) is emulated, slower than float32", stacklevel=2)
                return dtype, f"asked for; emulated: this CPU has no bf16 units: {features.describe()}"
        return dtype, "asked for"
    if dev.type == "cpu":
        features = _detect() if features is None else features
        if features.bf16_units:
            return torch.bfloat16, f"this CPU has bf16 units: {features.describe()}"
        return torch.float32, f"this CPU has no bf16 units: {features.describe()}"
    if dev.type == "cuda":
        native, gpu = _cuda_bf16(dev)
        if native:
            return torch.bfloat16, f"this GPU computes bf16 natively: {gpu}"
        return torch.float32, f"this GPU has no native bf16: {gpu}"
    return torch.float32, (f"auto picks bfloat16 only on a CPU with bf16 units or a CUDA GPU with native bf16; "
                           f"this is {dev.type}")


def _detect():
    from .kernels.cpu_features import CpuFeatures
    return CpuFeatures.detect()


def _cuda_bf16(dev) -> tuple[bool, str]:
    """(whether the CUDA device `dev` computes bf16 natively, its name)."""
    import torch
    with torch.cuda.device(dev.index):          # None: the current device
        return torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name()


def name_of(dtype) -> str:
    """torch.float32 -> "float32"."""
    return str(dtype).removeprefix("torch.")
