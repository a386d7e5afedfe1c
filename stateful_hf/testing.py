"""Offline fixtures: tiny seeded models built from configs in code and a BPE tokenizer trained here.

Nothing is downloaded. Weights are random (seeded) and scaled up so greedy decoding has clear
winners: float32 results of different but equivalent computation orders then pick the same tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

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


def _seeded_model(model_cls, config, seed: int, scale: float, norms: bool = False) -> torch.nn.Module:
    """`norms`: also perturb 1-D norm weights by N(0, 0.1), so RMSNorm weights (Gemma's 1 + weight,
    Qwen3's and Gemma's q_norm/k_norm) are not the identity."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)     # non-zero biases, so q/k/v biases (Qwen2, OPT) matter
            elif norms:
                p.add_(torch.randn_like(p) * 0.1)
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



_SMALL = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
              tie_word_embeddings=False)


def tiny_qwen3(seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer Qwen3: q_norm/k_norm per head before RoPE (weights perturbed), GQA 4:2, head_dim 16."""
    import transformers

    config = transformers.Qwen3Config(**{**_SMALL, "head_dim": 16, **overrides})
    return _seeded_model(transformers.Qwen3ForCausalLM, config, seed, scale, norms=True)


def tiny_gemma3(seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer Gemma 3 text model: layer 0 sliding (window 24 tokens, RoPE base 10^4), layer 1
    global (base 10^6), query_pre_attn_scalar 32 (not head_dim), RMSNorm 1 + weight (perturbed),
    QK-norm, embeddings scaled by sqrt(64). Pass num_attention_heads/num_key_value_heads/head_dim to
    change the heads (the Triton kernel wants head_dim 64)."""
    import transformers

    base = {**_SMALL, "head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
            "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
    config = transformers.Gemma3TextConfig(**{**base, **overrides})
    return _seeded_model(transformers.Gemma3ForCausalLM, config, seed, scale, norms=True)


def tiny_gemma2(seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer Gemma 2: sliding (window 24) then global layer, attention-logit softcap 2.0 (small,
    so it changes the attention) and final-logit softcap 5.0; eager attention (SDPA cannot softcap)."""
    import transformers

    base = {**_SMALL, "head_dim": 16, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
            "hidden_activation": "gelu_pytorch_tanh", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
    config = transformers.Gemma2Config(**{**base, **overrides, "attn_implementation": "eager"})
    return _seeded_model(transformers.Gemma2ForCausalLM, config, seed, scale, norms=True)


def tiny_phi3(seed: int = 0, scale: float = 0.15, **overrides) -> torch.nn.Module:
    """A 2-layer Phi-3: fused qkv_proj, partial rotary (half of head_dim 16), sliding window 24 on
    every layer."""
    import transformers

    base = {**_SMALL, "sliding_window": 24, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 2048,
            "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
    config = transformers.Phi3Config(**{**base, **overrides})
    return _seeded_model(transformers.Phi3ForCausalLM, config, seed, scale, norms=True)


TINY_FAMILIES = {"qwen3": tiny_qwen3, "gemma3": tiny_gemma3, "gemma2": tiny_gemma2, "phi3": tiny_phi3}


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


# ---- a tiny Qwen3 with Qwen3's chat template, for reasoning (`<think>`) -------------------------------

QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "Hmm,", " let me think.")
QWEN3_VOCAB = VOCAB_SIZE + len(QWEN3_ADDED)
QWEN3_TEMPLATE_PATH = Path(__file__).parent / "serve" / "templates" / "qwen3.jinja"


def qwen3_tokenizer():
    """`tiny_tokenizer`'s BPE with Qwen3's chat template (`serve/templates/qwen3.jinja`, Apache-2.0) and
    Qwen3's added tokens `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`,
    `</tool_response>` (not special, as in Qwen3's tokenizer: they stay in the decoded text), plus the
    two words of `tiny_qwen3_thinker`'s scripted reasoning ("Hmm,", " let me think.")."""
    tok = tiny_tokenizer()
    tok.add_tokens(list(QWEN3_ADDED), special_tokens=False)
    tok.chat_template = QWEN3_TEMPLATE_PATH.read_text()
    return tok


def tiny_qwen3_thinker(seed: int = 0, scale: float = 0.15) -> torch.nn.Module:
    """`tiny_qwen3` (vocabulary QWEN3_VOCAB, EOS `<|im_end|>`) that thinks before it answers: after the
    generation prompt's last token (`\\n`) it writes `<think>Hmm, let me think.</think>`, then its answer
    is the random model's own (context-dependent) tokens until `<|im_end|>` or max_tokens.

    How: the last 8 dims of the residual stream are a channel no layer reads or writes (those columns
    of every input projection and rows of every output projection are zero), so the final hidden state
    there is the current token's embedding: a bigram table `\\n` -> `<think>` -> `Hmm,` -> ` let me think.`
    -> `</think>`, strong enough to beat the random logits. The scripted tokens' random logits are zero,
    so the answer never writes them (a `\\n` in the answer would open another think block: its random
    logit is zero too). Everything else is the seeded random model: the answer depends on the whole
    context, so a reused turn that computed anything wrong answers differently."""
    tok = qwen3_tokenizer()
    model = tiny_qwen3(seed=seed, scale=scale, vocab_size=QWEN3_VOCAB, bos_token_id=0, eos_token_id=2,
                       pad_token_id=3)
    ids = [tok.convert_tokens_to_ids(t) for t in ("<think>", "Hmm,", " let me think.", "</think>")]
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1, newline
    chain = [newline[0], *ids]
    hidden, width = model.config.hidden_size, 8
    script = slice(hidden - width, hidden)
    with torch.no_grad():
        for name, p in model.model.layers.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                              "up_proj.weight")):
                p[:, script] = 0.0
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p[script, :] = 0.0
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb[:, script] = 0.0
        head[:, script] = 0.0
        for slot, (src, dst) in enumerate(zip(chain, chain[1:])):
            emb[src, hidden - width + slot] = 4.0
            head[dst, hidden - width + slot] = 3.0
        for t in chain:                        # the script's tokens come from the script alone
            head[t, : hidden - width] = 0.0
    model.generation_config.eos_token_id = 2
    return model
