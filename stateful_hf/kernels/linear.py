"""Linear layers on prepacked weights: the GEMM library's own weight layout, made once.

`F.linear` hands the BLAS a plain [out, in] weight, and at the engine's step sizes (tens of rows) the
BLAS spends most of the call repacking it: on a 2-core AVX-512 Xeon, SmolLM2's [1536, 576] projection
at 24 rows takes 1.0 ms through `F.linear` and 0.25 ms on MKL's packed weight
(`benchmarks/bench_linear.py`). The same holds for oneDNN's bf16 GEMM on AMX. So the engine packs each
weight once (`pack`) and multiplies with the packed copy (`apply`):

  - float32 -> MKL's packed sgemm (`mkl::_mkl_linear`);
  - bfloat16 -> oneDNN's packed matmul (`mkldnn::_linear_pointwise`), chosen only where the CPU has bf16
    units (AMX or AVX512-BF16): without them bf16 is emulated and packing does not pay;
  - anything else, or a device that is not the CPU -> `F.linear` (STOCK).

A packed copy is extra memory beside the weight (about the weight's size).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..options.modes import Mode
from .cpu_features import CpuFeatures


class LinearKernel(Mode):
    STOCK = "stock"                  # F.linear on the module's weight
    MKL_PACKED = "mkl-packed"        # float32, MKL's packed sgemm
    ONEDNN_PACKED = "onednn-packed"  # bfloat16, oneDNN's packed matmul

    @property
    def dtype(self) -> torch.dtype | None:
        """The weights' dtype a packed kernel takes (None: STOCK takes any)."""
        return {"mkl-packed": torch.float32, "onednn-packed": torch.bfloat16}.get(self.value)


def choose(dtype: torch.dtype, device: torch.device, features: CpuFeatures, *, required: bool = False) -> LinearKernel:
    """The packed kernel for weights of `dtype` on `device` on a CPU with `features`, else STOCK.
    `required`: no packed kernel is a ValueError saying why (prepack_weights=True)."""
    why = None
    if device.type != "cpu":
        why = f"prepacked weights are a CPU kernel; the model is on {device}"
    elif dtype == torch.float32:
        if features.mkl:
            return LinearKernel.MKL_PACKED
        why = "float32 packing needs torch built with MKL"
    elif dtype == torch.bfloat16:
        if features.onednn and features.bf16_units:
            return LinearKernel.ONEDNN_PACKED
        why = ("bfloat16 packing needs oneDNN and a CPU with bf16 units (AMX or AVX512-BF16); "
               f"this one has {features.describe()}")
    else:
        why = f"no packed kernel for {dtype} (float32 and bfloat16 have one)"
    if required:
        raise ValueError(f"prepack_weights=True: {why}")
    return LinearKernel.STOCK


def pack(weight: torch.Tensor, kernel: LinearKernel, rows: int) -> torch.Tensor:
    """The packed copy of `weight` [out, in] for `kernel`; `rows`: the typical row count (a hint)."""
    w = weight.detach()
    if kernel is LinearKernel.MKL_PACKED:
        return torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows)
    if kernel is LinearKernel.ONEDNN_PACKED:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
    raise ValueError(f"{kernel} has no packed weight")


def apply(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          kernel: LinearKernel) -> torch.Tensor:
    """x [..., in] @ weight.T + bias through `packed` (made by `pack` from `weight`): [..., out]."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel is LinearKernel.MKL_PACKED:
        out = torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])
    elif kernel is LinearKernel.ONEDNN_PACKED:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
