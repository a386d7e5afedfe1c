"""Quantized linear weights as transformers loads them (its torchao integration, `TorchAoConfig`).

The store and the engine leave a quantized weight to its own kernels (it is a tensor subclass: never
prepacked, never given the invariant GEMM's packed copy). What they need to know about it is here:
whether the model has any, and whether its activations are quantized per row at run time, which makes
a row's rounding depend on its input's last bits (so a 1-ulp difference between batches can flip a
token: such a store is batch-invariant by default, `integration/session_store.py`).

The named schemes a model loads with (`stateful_hf.models.SCHEMES`, `load(..., quantization=...)`) are
made there, through transformers; this module never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Quantization:
    """What a model's quantized linear weights are: `kind` the weight class (torchao's `Int8Tensor`),
    `layers` how many linear layers carry one, `dynamic_activations` whether activations are quantized
    per row at run time (unknown subclasses count as yes: the cautious reading)."""

    kind: str
    layers: int
    dynamic_activations: bool

    def __post_init__(self) -> None:
        assert self.layers > 0, "a Quantization describes at least one quantized layer"

    def describe(self) -> str:
        acts = "int8 activations per token" if self.dynamic_activations else "float activations"
        return f"{self.kind} on {self.layers} linear layers ({acts})"


def plain(w: torch.Tensor) -> bool:
    """A weight stored as a plain tensor; a tensor subclass (a torchao-quantized weight) keeps its own kernels."""
    return type(w.data) is torch.Tensor


def detect(model: torch.nn.Module) -> Quantization | None:
    """The model's quantized linear weights, or None when every linear weight is a plain tensor."""
    kinds: set[str] = set()
    layers, dynamic = 0, False
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and not plain(m.weight):
            w = m.weight.data
            layers += 1
            kinds.add(type(w).__name__)
            # torchao's Int8Tensor keeps `act_quant_kwargs` (None: weight-only); other subclasses: unknown
            dynamic |= getattr(w, "act_quant_kwargs", True) is not None
    return Quantization(" + ".join(sorted(kinds)), layers, dynamic) if layers else None
