"""Offline fixtures: tiny seeded models built from configs in code and a BPE tokenizer trained here.

Nothing is downloaded. Weights are random (seeded) and scaled up so greedy decoding has clear
winners: float32 results of different but equivalent computation orders then pick the same tokens.
"""

from __future__ import annotations

import functools

import torch

VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = """
The quick brown fox jumps over the lazy dog. A conversation keeps its state across turns.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Tell me about the weather, the sea, the mountains and the stars at night.
Servers re-read the whole conversation at every turn; a stateful server keeps what it computed.
Chunks of thirty-two tokens move between the device, the host and the disk.
def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
Please summarize the previous answer in one sentence. Sure, here it is.
""".strip().splitlines()


def _seeded_model(model_cls, config, seed: int, scale: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)     # non-zero biases, so q/k/v biases (Qwen2, OPT) matter
    return model


def tiny_llama(family: str = "llama", seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer Llama-family model: family "llama" (GQA 4:2, RoPE), "mistral" or "qwen2" (q/k/v biases)."""
    import transformers

    base = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    if family not in classes:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(classes)}")
    if family == "mistral":
        base["sliding_window"] = None
    config_cls, model_cls = classes[family]
    config = config_cls(**{**base, **overrides})
    return _seeded_model(model_cls, config, seed, scale)


def tiny_opt(seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer OPT (learned positions, biased projections); pass do_layer_norm_before=False for
    post-LayerNorm and word_embed_proj_dim != hidden_size for project_in/project_out."""
    import transformers

    base = dict(vocab_size=VOCAB_SIZE, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=2048, word_embed_proj_dim=64, do_layer_norm_before=True,
                pad_token_id=1, bos_token_id=2, eos_token_id=2, tie_word_embeddings=False)
    config = transformers.OPTConfig(**{**base, **overrides})
    return _seeded_model(transformers.OPTForCausalLM, config, seed, scale)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok.to_str()


def tiny_tokenizer():
    """A byte-level BPE (vocabulary VOCAB_SIZE) trained offline, with a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>", unk_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
