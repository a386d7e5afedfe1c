"""Per-architecture facts, in one place. Adding a model family = adding an entry here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
OPT_FAMILY = ("opt",)
SUPPORTED = LLAMA_FAMILY + OPT_FAMILY


class UnsupportedModelError(TypeError):
    pass


@dataclass(frozen=True, slots=True)
class ModelAdapter:
    model_type: str
    family: str                 # "llama" (RMSNorm, RoPE) or "opt" (LayerNorm, learned positions)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int             # rows of the input embedding: valid ids are 0 .. vocab_size - 1
    max_positions: int
    window: int | None          # sliding-window span, None when attention is full

    @property
    def kv_is_smaller_than_hidden(self) -> bool:
        return 2 * self.num_kv_heads * self.head_dim < self.num_heads * self.head_dim


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"stateful-hf supports model types {', '.join(SUPPORTED)}; got {model_type!r} "
            f"({type(model).__name__}). Adding a family means adding an adapter in stateful_hf/adapter.py.")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    window = None
    if model_type in LLAMA_FAMILY:
        sw = getattr(config, "sliding_window", None)
        uses = getattr(config, "use_sliding_window", True)
        layer_types = getattr(config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types) and len(set(layer_types)) > 1:
            raise UnsupportedModelError(f"{model_type}: mixed layer types {sorted(set(layer_types))} are not supported")
        if sw and uses and (not layer_types or layer_types[0] == "sliding_attention" or model_type == "mistral"):
            window = int(sw) if sw < config.max_position_embeddings else None
    return ModelAdapter(
        model_type=model_type,
        family="opt" if model_type in OPT_FAMILY else "llama",
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_positions=config.max_position_embeddings,
        window=window,
    )
