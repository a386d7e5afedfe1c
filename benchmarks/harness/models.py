"""Models shared by the benchmarks: random-weight configs built offline, or a named real model
(`--model smollm2-135m-instruct`, through stateful_hf.models)."""

from __future__ import annotations

import torch


def llama_100m(**overrides) -> torch.nn.Module:
    """~100M-parameter Llama (MHA unless overridden): 12 layers, hidden 768, 12 heads, vocab 32000."""
    import transformers

    config = transformers.LlamaConfig(**{
        "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def build(name: str | None, layers: int = 12) -> tuple[torch.nn.Module, object, str]:
    """(model, tokenizer or None, a description for reports). `name` None: `llama_100m` with `layers`
    layers and random weights (no tokenizer: workloads use random ids); else a named model or a path
    (stateful_hf.models.load), float32."""
    if name is None:
        model = llama_100m(num_hidden_layers=layers)
        return model, None, f"{n_params(model) / 1e6:.1f}M-parameter Llama ({layers} layers, random weights, float32)"
    from stateful_hf.models import load
    model, tokenizer = load(name, dtype=torch.float32)
    c = model.config
    return model, tokenizer, (f"{name} ({n_params(model) / 1e6:.1f}M parameters, {c.num_hidden_layers} layers, "
                              f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads, float32)")


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V of one token over all layers, float32."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim * 4


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
