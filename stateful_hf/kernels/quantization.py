"""Quantized linear weights as transformers loads them (its torchao integration, `TorchAoConfig`).

The store and the engine leave a quantized weight to its own kernels (it is a tensor subclass: never
prepacked, never given the invariant GEMM's packed copy). What they need to know about it is here:
whether the model has any, and whether its activations are quantized per row at run time, which makes
a row's rounding depend on its input's last bits (so a 1-ulp difference between batches can flip a
token: such a store is batch-invariant by default, `integration/session_store.py`).

Named schemes (`SCHEMES`): "int8-weight-only" (torchao `Int8WeightOnlyConfig`: int8 weights per output
channel, dequantized into the model's dtype for a float GEMM) and "int8-dynamic"
(`Int8DynamicActivationInt8WeightConfig`: int8 weights and int8 activations with per-token scales, an
int32-accumulating integer GEMM). torchao is the optional extra `stateful-hf[quant]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SCHEMES = ("int8-weight-only", "int8-dynamic")
INSTALL = "pip install 'stateful-hf[quant]'"


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


def torchao_config(scheme: str) -> Any:
    """transformers' `TorchAoConfig` for a named scheme (`SCHEMES`); ValueError naming them for another
    name, ImportError saying how to install torchao where it is missing. torchao's inductor settings are
    left alone (`set_inductor_config=False`): they are process-wide."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
    except ImportError as e:
        raise ImportError(f"quantization={scheme!r} needs torchao: {INSTALL}") from e
    from transformers import TorchAoConfig

    quant = Int8WeightOnlyConfig(set_inductor_config=False) if scheme == "int8-weight-only" else \
        Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    return TorchAoConfig(quant)


def quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Quantize a model built in code (the tiny fixtures) in place as `TorchAoConfig(scheme)` would at
    load time (torchao's `quantize_` on its linear layers but the output embedding, as transformers does)."""
    config = torchao_config(scheme)
    from torchao.quantization import quantize_

    head = model.get_output_embeddings()
    quantize_(model, config.quant_type, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m is not head)
    return model
