"""Tier movement: a session's KV moves between device, host, disk and dropped, and every turn comes
back exact; `store.summary()` shows the tiers and the traffic.
    python examples/tier_movement.py [MODEL]        # default smollm2-135m-instruct; tiny-random: offline
"""

import sys
import tempfile

import torch

import stateful_hf
from stateful_hf.models import load

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"   # or "tiny-random" (offline), or a path
model, tokenizer = load(MODEL)                                         # fetched once (stateful_hf.models)
with tempfile.TemporaryDirectory() as disk:
    store = stateful_hf.SessionStore(model, device_capacity=512, host_capacity=512, disk_dir=disk, disk_capacity=1024)
    cache = store.cache("alice")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea, the mountains "
                                          "and the stars at night."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    for where in ["device", "host", "disk", "dropped"]:
        out = model.generate(ids, cache=cache, max_new_tokens=16, do_sample=False)
        plain = model.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
        assert torch.equal(out, plain), "a stateful turn differs from stateless generate"
        turn = store.stats("alice").last_turn
        print(f"history came from {where:>7}: reused {turn.reused_tokens:3} (device {turn.reused_device}, "
              f"host {turn.swapped_in_host}, disk {turn.swapped_in_disk}), recomputed {turn.recomputed_tokens}")
        ids = torch.cat([out, tokenizer("And then?", return_tensors="pt")["input_ids"]], dim=1)
        chunks = range(len(store.session("alice").chunks))
        nxt = {"device": "host", "host": "disk", "disk": "dropped", "dropped": None}[where]
        if nxt:
            store.move("alice", chunks, nxt)                 # park the whole session one tier lower
            print(f"  moved to {nxt}: {store.residency('alice')}")
    print(store.summary())
    store.check_integrity()
    store.close()
