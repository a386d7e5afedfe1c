"""Linear layers on prepacked weights: the GEMM library's own weight layout, made once per weight.

`F.linear` hands the BLAS a plain [out, in] weight, and at the engine's step sizes (tens of rows) the
BLAS spends most of the call repacking it: on a 2-core AVX-512 Xeon, SmolLM2's [1536, 576] projection
at 24 rows takes 1.0 ms through `F.linear` and 0.25 ms on MKL's packed weight
(`benchmarks/bench_linear.py`). The same holds for oneDNN's bf16 GEMM on AMX. So the engine packs each
weight once (`pack`) and multiplies with the packed copy (`apply`):

  - float32 -> MKL's packed sgemm (`mkl::_mkl_linear`);
  - bfloat16 -> oneDNN's packed matmul (`mkldnn::_linear_pointwise`) where the CPU has bf16 units (AMX or
    AVX512-BF16); without them (bf16 GEMMs are emulated there) MKL's packed sgemm on a float32 copy of the
    weight, the rows cast up and the float32 sums rounded back to bf16 (MKL_UPCAST): the same arithmetic
    class as an emulated bf16 GEMM (bf16 products summed in float32, rounded once), at float32's speed;
  - anything else, or a device that is not the CPU -> `F.linear` (STOCK).

A packed copy is extra memory beside the weight (about the weight's size). A single row is no faster
packed (slower for narrow weights), so calls of fewer than MIN_ROWS rows keep `F.linear`.

`PackedWeights.install(model, kernel, rows)` packs every `nn.Linear` of a model once (the decoder
layers' projections and the LM head) and gives each an instance-level `forward` that multiplies by the
packed copy while this thread is inside `active()` (the engine's runner, around one step), and calls
`F.linear` on the module's own weight otherwise: any other call of the model, stateless `generate` the
oracle included, runs exactly as before. A quantized weight (a tensor subclass, `kernels/quantization.py`)
keeps its own kernels: its layer is not packed. The model's classes, parameters and state dict are untouched.
A packed copy follows its weight: a weight replaced, moved, cast or changed in place (a new
`data_ptr`, dtype or version) is packed again before its next use, so a stale copy is never read.

The engine's compiled step (`integration/compiled_step.py`) cannot read `active()` (a ContextVar) in its graph:
`PackedWeights.in_graph()` gives each MKL-packed layer a slot, and a traced call of that layer is
`torch.ops.stateful_hf.packed_linear(rows, weight, bias, slot)`: an op of its own, whose body finds the layer's
packed copy by its slot when it runs, repacks it if the weight changed (the eager path's check), and calls MKL's
packed GEMM. The copy is never a graph constant (a graph traced over it would keep a stale copy: a test shows it),
and MKL's own op cannot be traced directly (it takes the call's row count as a plain int, which the graph's
unbacked token count cannot be).
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..options.modes import Mode
from .cpu_features import CpuFeatures
from .quantization import plain

MIN_ROWS = 2                         # fewer rows: F.linear (a GEMV gains nothing from packing)
TRIAL_ROWS = (16, 64)                # `measure`'s row counts (capped at the engine's rows per step)
PAYS = 0.9                           # auto packs when the packed calls take at most this share of F.linear's


class LinearKernel(Mode):
    STOCK = "stock"                  # F.linear on the module's weight
    MKL_PACKED = "mkl-packed"        # float32, MKL's packed sgemm
    ONEDNN_PACKED = "onednn-packed"  # bfloat16, oneDNN's packed matmul
    MKL_UPCAST = "mkl-upcast"        # bfloat16 without bf16 units: MKL's packed sgemm of a float32 copy

    @property
    def dtype(self) -> torch.dtype | None:
        """The weights' dtype a packed kernel takes (None: STOCK takes any)."""
        return {"mkl-packed": torch.float32, "onednn-packed": torch.bfloat16,
                "mkl-upcast": torch.bfloat16}.get(self.value)


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
        if features.mkl:
            return LinearKernel.MKL_UPCAST
        why = ("bfloat16 packing needs oneDNN and a CPU with bf16 units (AMX or AVX512-BF16), or torch built "
               f"with MKL; this one has {features.describe()}")
    else:
        why = f"no packed kernel for {dtype} (float32 and bfloat16 have one)"
    if required:
        raise ValueError(f"prepack_weights=True: {why}")
    return LinearKernel.STOCK


def pack(weight: torch.Tensor, kernel: LinearKernel, rows: int) -> torch.Tensor:
    """The packed copy of `weight` [out, in] for `kernel`; `rows`: the typical row count (a hint)."""
    w = weight.detach()
    if kernel in (LinearKernel.MKL_PACKED, LinearKernel.MKL_UPCAST):
        return torch.ops.mkl._mkl_reorder_linear_weight(w.float().contiguous(), rows)
    if kernel is LinearKernel.ONEDNN_PACKED:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)
    raise ValueError(f"{kernel} has no packed weight")


def apply(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          kernel: LinearKernel) -> torch.Tensor:
    """x [..., in] @ weight.T + bias through `packed` (made by `pack` from `weight`): [..., out]."""
    rows = x.reshape(-1, x.shape[-1])
    if kernel is LinearKernel.MKL_UPCAST:
        out = sums(rows, packed, weight, bias).to(x.dtype)
    elif kernel is LinearKernel.MKL_PACKED:
        out = torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])
    elif kernel is LinearKernel.ONEDNN_PACKED:
        out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    else:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


_ATTR = "_stateful_hf_packed"
_ACTIVE: ContextVar[bool] = ContextVar("stateful_hf_packed", default=False)

# the packed forwards a compiled graph calls, by slot (`PackedWeights.in_graph`); weak: a dropped model's go
_SLOTS: dict[int, weakref.ref] = {}
_next_slot = itertools.count()
_LIB = torch.library.Library("stateful_hf", "FRAGMENT")
_LIB.define("packed_linear(Tensor rows, Tensor weight, Tensor? bias, int slot) -> Tensor")


def _packed_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> torch.Tensor:
    """rows [M, in] @ weight.T + bias through MKL's packed copy of the float32 `weight` held by the packed
    forward in `slot`, repacked first if its weight changed (as the eager path does on every call): [M, out]."""
    forward = _SLOTS[slot]()
    if forward is None:
        raise RuntimeError(f"stateful_hf::packed_linear: slot {slot}'s layer is gone (its model was dropped)")
    w = forward.module.weight
    if not forward._current(w):
        forward.repack()
    return torch.ops.mkl._mkl_linear(rows, forward.packed, w, bias, rows.shape[0])


def _packed_linear_fake(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        slot: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0])


_LIB.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("stateful_hf::packed_linear", _packed_linear_fake, lib=_LIB)


def sums(rows: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, in] @ weight.T + bias in float32 through MKL's `packed` copy of `weight` (a float32 or a
    bf16 weight: MKL_PACKED or MKL_UPCAST): [M, out] float32, before any rounding."""
    if weight.dtype != torch.float32:
        # _mkl_linear reads only the shape of its float32 "origin" weight when M is the call's own row
        # count (always here): a zero-stride float32 view carries it without a float32 copy
        rows, bias = rows.float(), None if bias is None else bias.float()
        weight = torch.zeros((), dtype=torch.float32).expand(weight.shape)
    return torch.ops.mkl._mkl_linear(rows, packed, weight, bias, rows.shape[0])


def packable(m: torch.nn.Module, kernel: LinearKernel) -> bool:
    """A linear layer `kernel` can pack: a plain weight (not quantized) of the kernel's dtype."""
    return isinstance(m, torch.nn.Linear) and plain(m.weight) and m.weight.dtype == kernel.dtype


def weight_key(w: torch.Tensor) -> tuple:
    """What a packed copy was made from: the tensor, its storage, dtype, shape and in-place version."""
    try:
        version = w._version
    except RuntimeError:                  # an inference tensor has no version counter (never changes in place)
        version = -1
    return id(w), w.data_ptr(), w.dtype, tuple(w.shape), version


class _PackedForward:
    """The instance `forward` of one nn.Linear: the packed kernel inside `active()`, else F.linear. The hot path
    (a packed call) checks, in order: not compiling, active, the row dtype, the weight is the one packed (same
    object, storage and in-place version: `weight_key`'s facts, read without building the key), the CPU, the rows."""

    __slots__ = ("module", "kernel", "dtype", "rows", "packed", "key", "weight", "ptr", "version", "min_numel",
                 "shape", "out_features", "op", "graph", "__weakref__")

    def __init__(self, module: torch.nn.Linear, kernel: LinearKernel, rows: int):
        self.module, self.kernel, self.dtype, self.rows = module, kernel, kernel.dtype, rows
        self.min_numel = MIN_ROWS * module.in_features
        self.op = torch.ops.mkl._mkl_linear.default if kernel is LinearKernel.MKL_PACKED else None
        self.graph: int | None = None       # the slot a traced call names (`PackedWeights.in_graph`); None: F.linear
        self.packed, self.key = None, None
        self.repack()

    def repack(self) -> None:
        w = self.module.weight
        self.packed, self.key = pack(w, self.kernel, self.rows), weight_key(w)
        self.weight, self.ptr, self.version = w, w.data_ptr(), self.key[-1]
        self.shape, self.out_features = w.shape, w.shape[0]

    def _current(self, w: torch.Tensor) -> bool:
        """Whether the packed copy was made from `w` as it is now (`weight_key(w) == self.key`, cheaply)."""
        if w is not self.weight or w.data_ptr() != self.ptr or w.dtype != self.dtype or w.shape != self.shape:
            return False
        return self.version == -1 or w._version == self.version

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        w = m.weight
        if torch.compiler.is_compiling():   # a compiled step: no ContextVar; the packed op, or the compiler's GEMM
            if self.graph is not None:
                rows = x.reshape(-1, x.shape[-1])
                return torch.ops.stateful_hf.packed_linear(rows, w, m.bias, self.graph).view(*x.shape[:-1],
                                                                                              self.out_features)
            return F.linear(x, w, m.bias)
        if (not _ACTIVE.get() or x.dtype != self.dtype or w.dtype != self.dtype or x.device.type != "cpu"
                or x.numel() < self.min_numel):
            return F.linear(x, w, m.bias)
        if not self._current(w):
            self.repack()
        if self.op is not None:             # MKL_PACKED, apply's float32 path inlined
            rows = x.reshape(-1, x.shape[-1])
            return self.op(rows, self.packed, w, m.bias, rows.shape[0]).view(*x.shape[:-1], self.out_features)
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
            if packable(module, kernel):
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

    def in_graph(self) -> bool:
        """Make a traced (compiled) call of each MKL-packed layer `stateful_hf::packed_linear` on its slot,
        whatever the ContextVar; returns whether any layer is (the other kernels keep the compiler's GEMM). Before
        a trace: a graph traced earlier keeps what it traced."""
        for f in self.forwards:
            if f.op is not None and f.graph is None:
                f.graph = next(_next_slot)
                _SLOTS[f.graph] = weakref.ref(f, lambda _, slot=f.graph: _SLOTS.pop(slot, None))
        return any(f.graph is not None for f in self.forwards)

    @property
    def graph_layers(self) -> int:
        """How many layers a traced call multiplies by their packed copies (`in_graph`)."""
        return sum(f.graph is not None for f in self.forwards)

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies take."""
        return sum(f.packed.untyped_storage().nbytes() for f in self.forwards)


@dataclass(frozen=True, slots=True)
class PackingTrial:
    """`measure`'s answer: seconds of the model's linear calls (each shape once per layer that has it, at each of
    `rows`) through F.linear and through `kernel`'s packed copy, best of the trial's rounds."""

    kernel: LinearKernel
    rows: tuple[int, ...]
    stock_s: float
    packed_s: float

    @property
    def pays(self) -> bool:
        """Whether packing is worth its memory here: the packed calls took at most PAYS of F.linear's time (never
        where no decoder weight could be timed: all quantized)."""
        return self.stock_s > 0 and self.packed_s <= PAYS * self.stock_s

    def describe(self) -> str:
        if self.stock_s == 0:
            return f"{self.kernel}: no plain decoder weight to pack (quantized weights keep their own kernels)"
        return (f"{self.kernel} measured x{self.stock_s / max(self.packed_s, 1e-12):.2f} F.linear's speed at "
                f"{'/'.join(map(str, self.rows))} rows ({'packed' if self.pays else 'F.linear'}: packing pays at "
                f"x{1 / PAYS:.2f})")


def measure(model: torch.nn.Module, kernel: LinearKernel, rows: int, rounds: int = 5) -> PackingTrial:
    """Time the model's own linear weights (every decoder shape, weighted by how many layers have it; not the LM
    head, which multiplies only the sampled rows) at TRIAL_ROWS rows capped at `rows`, through F.linear and
    through `kernel`'s packed call as the engine makes it (`_PackedForward`, inside `active()`), interleaved
    round by round on this thread; each side's best round counts (a neighbour's burst lands in some rounds only).
    Packs one copy per shape for the trial and drops it after. Capability says which packed kernel exists; this
    says whether it is faster on this CPU (at width 64, or on an AVX2 EPYC at tens of rows, it is not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: Counter = Counter()
    modules: dict[tuple[int, int], torch.nn.Linear] = {}
    for m in model.modules():
        if m is not head and packable(m, kernel):
            key = (m.in_features, m.out_features)
            shapes[key] += 1
            modules.setdefault(key, m)
    counts = tuple(sorted({max(MIN_ROWS, min(r, rows)) for r in TRIAL_ROWS}))
    trials = []
    for key, m in modules.items():
        fwd = _PackedForward(m, kernel, rows)
        for r in counts:
            x = torch.randn(r, key[0], dtype=m.weight.dtype, device=m.weight.device)
            trials.append((shapes[key], x, m, fwd))
    best = [float("inf"), float("inf")]
    with torch.inference_mode(), PackedWeights.active():
        for _ in range(rounds + 1):                # the first round warms both paths up
            took = [0.0, 0.0]
            for count, x, m, fwd in trials:
                t0 = time.perf_counter()
                F.linear(x, m.weight, m.bias)
                t1 = time.perf_counter()
                fwd(x)
                took[0] += count * (t1 - t0)
                took[1] += count * (time.perf_counter() - t1)
            best = [min(b, t) for b, t in zip(best, took)]
    return PackingTrial(kernel, counts, best[0], best[1])
