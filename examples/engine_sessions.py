"""The engine: several chat sessions served together (one forward per step mixes their prompt and
decode tokens), from several threads, with streaming, metrics and a typing hint.
    python examples/engine_sessions.py [MODEL]      # default smollm2-135m-instruct; tiny-random: offline
"""

import sys
import threading

import stateful_hf
from stateful_hf import Engine, SamplingParams
from stateful_hf.models import load

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"   # or "tiny-random" (offline), or a path
model, tokenizer = load(MODEL)                                         # fetched once (stateful_hf.models)
store = stateful_hf.SessionStore(model, device_capacity=1024, host_capacity=4096, chunk_size=16)
engine = Engine(model, tokenizer, store=store, max_batch_tokens=256).start()   # background step loop
greedy = SamplingParams(max_new_tokens=12)
questions = ["Hello! How are you today?", "Tell me about the sea.", "And the mountains?"]
lock = threading.Lock()


def user(name: str) -> None:
    for q in questions:
        engine.hint(name)                                    # "the user is typing": prefetch its KV
        handle = engine.chat_submit(name, q, greedy)         # the engine keeps the conversation
        text = "".join(handle.text_deltas())                 # streamed as it is generated
        m = handle.result().metrics
        with lock:
            print(f"{name:>6} | {q:<28} | ttft {1e3 * m.ttft:6.1f} ms | reused {m.reused_tokens:3} "
                  f"| prompt {m.prompt_tokens:3} | {text[:24]!r}")


threads = [threading.Thread(target=user, args=(f"user{i}",)) for i in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
engine.stop()
st = engine.stats()
print(f"{st.steps} steps, {st.finished_requests} turns, {st.generated_tokens} tokens generated, "
      f"mean {st.mean_batch_tokens:.1f} tokens per forward")
print(store.summary())
