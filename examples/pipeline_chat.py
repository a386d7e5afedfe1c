"""The drop-in pipeline: transformers' text-generation pipeline, plus `session_id=`.

Code written for `transformers.pipeline("text-generation", ...)` keeps working; passing the growing
message list with a session id each turn computes only the new tokens.
    python examples/pipeline_chat.py [MODEL]        # default smollm2-135m-instruct; tiny-random: offline
"""

import sys

import transformers

import stateful_hf
from stateful_hf.models import load

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"   # or "tiny-random" (offline), or a path
model, tokenizer = load(MODEL)                                         # fetched once (stateful_hf.models)

chat = stateful_hf.pipeline("text-generation", model=model, tokenizer=tokenizer, device_capacity=4096)
messages = [{"role": "system", "content": "You are brief."}]
for user in ["Hello! How are you today?", "Tell me about the sea.", "Summarize that in one sentence."]:
    messages.append({"role": "user", "content": user})
    out = chat(messages, session_id="alice", max_new_tokens=16, do_sample=False)
    messages = out[0]["generated_text"]                      # the chat, with the new assistant message
    turn = chat.store.stats("alice").last_turn
    # computed_tokens counts every row the model ran: the prompt's, then one per generated token but the last
    computed = turn.computed_tokens - max(turn.generated_tokens - 1, 0)     # of the prompt
    print(f"user: {user}\nassistant: {messages[-1]['content']!r}")
    print(f"  [{turn.reused_tokens} prompt tokens reused + {computed} computed; {turn.generated_tokens} generated]")

# The same task is registered with transformers (by the first use of a stateful_hf name, above):
same = transformers.pipeline("stateful-text-generation", model=chat.model, tokenizer=chat.tokenizer)
print(type(same).__name__, same("The quick brown fox", max_new_tokens=8, do_sample=False)[0]["generated_text"][:40])
