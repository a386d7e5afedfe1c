"""Multi-turn `model.generate` with a StatefulCache: each turn computes only its new tokens.

Runs offline on the tiny random-weight fixture; pass a checkpoint path to use a real model:
    python examples/multiturn_generate.py [MODEL_PATH]
"""

import sys

import torch

import stateful_hf
from stateful_hf.testing import tiny_llama, tiny_tokenizer

if len(sys.argv) > 1:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
else:
    model, tokenizer = tiny_llama(), tiny_tokenizer()

store = stateful_hf.SessionStore(model, device_capacity=4096)     # tokens, or a size like "2GiB"
cache = store.cache("alice")
messages = []
for user in ["Hello! How are you today?", "Tell me about the sea.", "Summarize that in one sentence."]:
    messages.append({"role": "user", "content": user})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(ids["input_ids"], cache=cache, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    messages.append({"role": "assistant", "content": reply})
    turn = store.stats("alice").last_turn
    print(f"user: {user}\nassistant: {reply!r}")
    print(f"  [{turn.reused_tokens} tokens reused, {turn.computed_tokens} computed]")
print(store.stats())
