"""Model configs shared by the benchmarks: random weights, built offline."""

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


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
