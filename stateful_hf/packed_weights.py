"""Packed copies of a model's linear weights, used by the engine's steps (`kernels/linear.py`).

`PackedWeights.install(model, kernel, rows)` packs every `nn.Linear` of the model once (the decoder
layers' projections and the LM head) and gives each an instance-level `forward` that multiplies by the
packed copy while this thread is inside `active()` (the engine's runner, around one step), and calls
`F.linear` on the module's own weight otherwise: any other call of the model, stateless `generate` the
oracle included, runs exactly as before. The model's classes, parameters and state dict are untouched.

A packed copy follows its weight: a weight replaced, moved, cast or changed in place (a new
`data_ptr`, dtype or version) is packed again before its next use, so a stale copy is never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from .kernels.linear import LinearKernel, apply, pack

_ATTR = "_stateful_hf_packed"
_ACTIVE: ContextVar[bool] = ContextVar("stateful_hf_packed", default=False)


def _key(w: torch.Tensor) -> tuple:
    """What a packed copy was made from: the tensor, its storage, dtype, shape and in-place version."""
    try:
        version = w._version
    except RuntimeError:                  # an inference tensor has no version counter (never changes in place)
        version = -1
    return id(w), w.data_ptr(), w.dtype, tuple(w.shape), version


class _PackedForward:
    """The instance `forward` of one nn.Linear: the packed kernel inside `active()`, else F.linear."""

    __slots__ = ("module", "kernel", "dtype", "rows", "packed", "key")

    def __init__(self, module: torch.nn.Linear, kernel: LinearKernel, rows: int):
        self.module, self.kernel, self.dtype, self.rows = module, kernel, kernel.dtype, rows
        self.packed, self.key = None, None
        self.repack()

    def repack(self) -> None:
        w = self.module.weight
        self.packed, self.key = pack(w, self.kernel, self.rows), _key(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w = m.weight
        if not _ACTIVE.get() or x.dtype != self.dtype or w.dtype != self.dtype or x.device.type != "cpu":
            return F.linear(x, w, m.bias)
        if _key(w) != self.key:
            self.repack()
        return apply(x, self.packed, w, m.bias, self.kernel)


class PackedWeights:
    """The packed forwards installed on one model (at most one set per model: `install` is idempotent)."""

    def __init__(self, kernel: LinearKernel, forwards: list[_PackedForward]):
        self.kernel, self.forwards = kernel, forwards

    @classmethod
    def install(cls, model: torch.nn.Module, kernel: LinearKernel, rows: int) -> PackedWeights:
        """Pack every nn.Linear of `model` for `kernel` (not STOCK); `rows`: typical rows per call."""
        if kernel is LinearKernel.STOCK:
            raise ValueError("STOCK has no packed weights")
        have = getattr(model, _ATTR, None)
        if have is not None:
            if have.kernel is not kernel:
                raise ValueError(f"the model's weights are packed for {have.kernel}, not {kernel}")
            return have
        forwards = []
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.dtype == kernel.dtype:
                fwd = _PackedForward(module, kernel, rows)
                module.forward = fwd
                forwards.append(fwd)
        packed = cls(kernel, forwards)
        setattr(model, _ATTR, packed)
        return packed

    @staticmethod
    @contextmanager
    def active() -> Iterator[None]:
        """Inside the block, this thread's linear layers multiply by their packed copies."""
        token = _ACTIVE.set(True)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies take."""
        return sum(f.packed.untyped_storage().nbytes() for f in self.forwards)
