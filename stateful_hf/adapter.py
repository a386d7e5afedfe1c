"""Per-architecture facts, in one place. Adding a model family = adding an entry here."""

from __future__ import annotations

import sys
from collections.abc import Callable
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
    hidden_size: int = 0        # width of the residual stream entering each decoder layer

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
        hidden_size=config.hidden_size,
    )


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers, in order (Llama family: model.layers; OPT: decoder.layers)."""
    base = model.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = base.decoder.layers
    return layers


def kv_projector(model: torch.nn.Module, adapter: ModelAdapter) -> Callable:
    """HCache's restore of one layer's K/V from the hidden state entering it, through the model's
    own modules: `project(layer, hidden [n, D], positions [n]) -> (K, V)`, each [n, kv_heads, head_dim].

    Llama family: input RMSNorm -> k/v projections (with their biases, e.g. Qwen2) -> RoPE on K at
    the absolute positions (the model's rotary embedding module and its apply_rotary_pos_emb).
    OPT: self_attn_layer_norm when do_layer_norm_before, none otherwise (post-LN) -> biased k/v
    projections; no RoPE (learned positions are already inside the hidden state)."""
    layers = decoder_layers(model)
    hkv, hd = adapter.num_kv_heads, adapter.head_dim
    if adapter.family == "opt":
        pre_ln = model.config.do_layer_norm_before

        def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor):
            mod = layers[layer]
            x = mod.self_attn_layer_norm(hidden) if pre_ln else hidden
            attn = mod.self_attn
            return attn.k_proj(x).view(-1, hkv, hd), attn.v_proj(x).view(-1, hkv, hd)
        return project

    rotary = model.base_model.rotary_emb
    apply_rope = sys.modules[type(layers[0].self_attn).__module__].apply_rotary_pos_emb

    def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        mod = layers[layer]
        x = mod.input_layernorm(hidden)                                   # [n, D]
        k = mod.self_attn.k_proj(x).view(1, -1, hkv, hd).transpose(1, 2)   # [1, Hkv, n, hd]
        v = mod.self_attn.v_proj(x).view(-1, hkv, hd)
        cos, sin = rotary(x[None], positions[None])                       # [1, n, hd]
        _, k = apply_rope(k, k, cos, sin)
        return k[0].transpose(0, 1), v
    return project
