"""Per-architecture facts, in one place. Adding a model family = adding an entry here (and, when its
K/V are not `k_proj`/`v_proj` of the input-normed hidden state, a case in `projector.py`).

What each supported family brings, and where it is honoured:
  llama, mistral, qwen2   RMSNorm, RoPE, GQA; q/k/v biases (qwen2); sliding window (mistral: every
                          layer; qwen2: layers of type "sliding_attention").
  qwen3                   + per-head RMSNorm on queries and keys (q_norm, k_norm) before RoPE.
  gemma3_text             + "sliding_attention"/"full_attention" layers, a RoPE base per layer type,
                          query_pre_attn_scalar scaling, RMSNorm with 1 + weight, embeddings scaled
                          by sqrt(hidden), QK-norm. (The modules do these; the store sees per-layer
                          windows and the attention kwargs.)
  gemma2                  + attention-logit softcapping (tanh) and a final-logit softcap.
  phi3                    fused qkv_proj, partial rotary, one sliding window on every layer.
  opt                     LayerNorm (pre or post), learned positions, biased projections.
Per-layer windows, scaling and the attention-logit softcap are what transformers passes to the
attention interface; the registered attention honours them and checks the window against
`layer_windows` on every call (see attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma2", "phi3")
OPT_FAMILY = ("opt",)
SUPPORTED = LLAMA_FAMILY + OPT_FAMILY
CONFIG_WINDOW = ("mistral", "phi3")   # their attention passes config.sliding_window for every layer


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
    layer_windows: tuple[int | None, ...] = ()   # [num_layers] sliding-window span per layer, None: full
    hidden_size: int = 0        # width of the residual stream entering each decoder layer
    final_softcap: float | None = None   # the LM head's logit softcap (cap * tanh(x / cap)), None: none

    @property
    def kv_is_smaller_than_hidden(self) -> bool:
        return 2 * self.num_kv_heads * self.head_dim < self.num_heads * self.head_dim


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        raise UnsupportedModelError("gemma3 (multimodal, Gemma3ForConditionalGeneration) is not supported: load the "
                                    "text model (Gemma3ForCausalLM, model_type gemma3_text)")
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"stateful-hf supports model types {', '.join(SUPPORTED)}; got {model_type!r} "
            f"({type(model).__name__}). Adding a family means adding an adapter in stateful_hf/integration/adapter.py.")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError("encoder-decoder models are not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{model_type}: use_bidirectional_attention=True is not causal; a session "
                                    "cache needs causal attention")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelAdapter(
        model_type=model_type,
        family="opt" if model_type in OPT_FAMILY else "llama",
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_positions=_max_positions(config),
        layer_windows=_layer_windows(model, model_type),
        hidden_size=config.hidden_size,
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


def _layer_windows(model: torch.nn.Module, model_type: str) -> tuple[int | None, ...]:
    """The window each layer's attention passes to the attention interface (transformers 5.x):
    its own `sliding_window` attribute (qwen2/qwen3/gemma2/gemma3: set on "sliding_attention"
    layers), config.sliding_window (mistral, phi3), else none."""
    if model_type in OPT_FAMILY:
        return (None,) * model.config.num_hidden_layers
    windows = []
    for layer in decoder_layers(model):
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):
            w = attn.sliding_window
        elif model_type in CONFIG_WINDOW:
            w = getattr(model.config, "sliding_window", None)
        else:
            w = None
        windows.append(None if w is None else int(w))
    return tuple(windows)


def _max_positions(config) -> int:
    """The context a session may reach. RoPE whose frequencies depend on the sequence's length
    (dynamic NTK, Phi-3's longrope: long factors past original_max_position_embeddings) would give
    cached keys other rotations than a stateless forward over the longer sequence, so such models
    are held to the original context, where their rotation does not change."""
    limit = config.max_position_embeddings
    params = getattr(config, "rope_parameters", None) or {}
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    for p in per_type:
        rope_type = (p or {}).get("rope_type", "default")
        if "dynamic" in rope_type or rope_type == "longrope":
            original = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                             None)
            if not original:
                raise UnsupportedModelError(f"{config.model_type}: rope_type {rope_type!r} without "
                                            "original_max_position_embeddings")
            limit = min(limit, int(original))
    return limit


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers, in order (Llama family: model.layers; OPT: decoder.layers)."""
    base = model.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        layers = base.decoder.layers
    return layers
