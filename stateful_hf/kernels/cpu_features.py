"""What this CPU can do for the kernels that depend on it, read once: kernels are chosen by capability,
never by vendor (an AMD Zen 4 has AVX512-BF16 without AMX; some Xeons have neither).

`CpuFeatures.detect()` asks torch (the same probes its own CPU dispatch uses) and, on Linux,
/proc/cpuinfo's flags; tests build a `CpuFeatures` by hand to check the dispatch with faked flags.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    avx512: bool             # AVX-512 F
    avx512_bf16: bool        # AVX512_BF16: bf16 dot products in vector registers
    amx_bf16: bool           # AMX tiles with bf16 (Sapphire Rapids and later)
    mkl: bool                # torch built with MKL (packed fp32 GEMM)
    onednn: bool             # torch built with oneDNN (packed bf16 GEMM)

    @property
    def bf16_units(self) -> bool:
        """bf16 arithmetic in hardware; without it oneDNN emulates bf16, slower than float32."""
        return self.amx_bf16 or self.avx512_bf16

    def describe(self) -> str:
        """One line for start-up logs: 'AMX-BF16, AVX512-BF16, AVX-512; MKL, oneDNN'."""
        units = [n for n, on in (("AMX-BF16", self.amx_bf16), ("AVX512-BF16", self.avx512_bf16),
                                 ("AVX-512", self.avx512)) if on] or ["no AVX-512"]
        libs = [n for n, on in (("MKL", self.mkl), ("oneDNN", self.onednn)) if on] or ["no MKL or oneDNN"]
        return f"{', '.join(units)}; {', '.join(libs)}"

    @staticmethod
    @functools.cache
    def detect() -> CpuFeatures:
        flags = _cpuinfo_flags()
        probe = lambda name: bool(getattr(torch.cpu, name, lambda: False)())    # noqa: E731
        amx_tile = probe("_is_amx_tile_supported")
        return CpuFeatures(
            avx512=probe("_is_avx512_supported") or "avx512f" in flags,
            avx512_bf16=probe("_is_avx512_bf16_supported") or "avx512_bf16" in flags,
            amx_bf16=("amx_bf16" in flags) if flags else amx_tile,
            mkl=torch.backends.mkl.is_available(),
            onednn=torch.backends.mkldnn.is_available(),
        )


def _cpuinfo_flags() -> frozenset[str]:
    """The first CPU's flags from /proc/cpuinfo; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
