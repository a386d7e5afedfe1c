"""HCache's restore of one layer's K/V from the hidden state entering it, through the model's own
modules, for every family of `adapter.py`."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .adapter import ModelAdapter, decoder_layers


def kv_projector(model: torch.nn.Module, adapter: ModelAdapter) -> Callable:
    """`project(layer, hidden [n, D], positions [n]) -> (K, V)`, each [n, kv_heads, head_dim],
    exactly the K/V the layer's attention computes for those rows.

    RoPE families: input norm (the layer's own module: RMSNorm, Gemma's 1 + weight) -> K and V
    projections (k_proj/v_proj with their biases, or the K and V rows of Phi-3's fused qkv_proj)
    -> k_norm per head when the attention has one (Qwen3, Gemma 3) -> RoPE on K at the absolute
    positions, with the layer's own rotary (Gemma 3: its layer type's base) and the modeling file's
    apply_rotary_pos_emb (Phi-3: partial rotary).
    OPT: self_attn_layer_norm when do_layer_norm_before, none otherwise (post-LN) -> biased k/v
    projections; no RoPE (learned positions are already inside the hidden state)."""
    layers = decoder_layers(model)
    hkv, hd = adapter.num_kv_heads, adapter.head_dim
    if adapter.family == "opt":
        pre_ln = model.config.do_layer_norm_before

        def project_opt(layer: int, hidden: torch.Tensor, positions: torch.Tensor):
            mod = layers[layer]
            x = mod.self_attn_layer_norm(hidden) if pre_ln else hidden
            attn = mod.self_attn
            return attn.k_proj(x).view(-1, hkv, hd), attn.v_proj(x).view(-1, hkv, hd)
        return project_opt

    rotary = model.base_model.rotary_emb
    apply_rope = sys.modules[type(layers[0].self_attn).__module__].apply_rotary_pos_emb
    layer_types = getattr(model.config, "layer_types", None)
    per_type = layer_types is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    kv_of = _fused_kv(hkv * hd, adapter.num_heads * hd) if hasattr(layers[0].self_attn, "qkv_proj") else _split_kv

    def project(layer: int, hidden: torch.Tensor, positions: torch.Tensor):
        mod = layers[layer]
        attn = mod.self_attn
        x = mod.input_layernorm(hidden)                                   # [n, D]
        k, v = kv_of(attn, x)                                             # [n, Hkv * hd] each
        k = k.view(1, -1, hkv, hd)
        k_norm = getattr(attn, "k_norm", None)
        if k_norm is not None:
            k = k_norm(k)                                                 # per head, over hd
        k = k.transpose(1, 2)                                             # [1, Hkv, n, hd]
        extra = (layer_types[layer],) if per_type else ()
        cos, sin = rotary(x[None], positions[None], *extra)               # [1, n, rotary dim]
        _, k = apply_rope(k, k, cos, sin)
        return k[0].transpose(0, 1), v.view(-1, hkv, hd)
    return project


def _split_kv(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return attn.k_proj(x), attn.v_proj(x)


def _fused_kv(kv_width: int, q_width: int) -> Callable:
    """Phi-3: qkv_proj's output is [q (Hq * hd) | k (Hkv * hd) | v (Hkv * hd)]; only its K and V rows
    are computed."""
    def kv_of(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        proj = attn.qkv_proj
        bias = None if proj.bias is None else proj.bias[q_width:]
        kv = F.linear(x, proj.weight[q_width:], bias)                     # [n, 2 * Hkv * hd]
        return kv[:, :kv_width], kv[:, kv_width:]
    return kv_of
