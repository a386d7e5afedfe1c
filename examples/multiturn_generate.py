"""Multi-turn `model.generate` with a StatefulCache: each turn computes only its new tokens.

    python examples/multiturn_generate.py [MODEL]   # default smollm2-135m-instruct; tiny-random: offline
"""

import sys

import stateful_hf
from stateful_hf.models import load

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"   # or "tiny-random" (offline), or a path
model, tokenizer = load(MODEL)                                         # fetched once (stateful_hf.models)

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
    # computed_tokens counts every row the model ran: the prompt's, then one per generated token but the last
    computed = turn.computed_tokens - max(turn.generated_tokens - 1, 0)     # of the prompt
    print(f"user: {user}\nassistant: {reply!r}")
    print(f"  [prompt {ids['input_ids'].shape[1]}: {turn.reused_tokens} reused + {computed} computed; "
          f"{turn.generated_tokens} generated]")
print(store.stats())
