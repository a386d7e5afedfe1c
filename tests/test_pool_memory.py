"""Pools take memory as they are used: a 4 GiB host tier (and a 1 GiB device pool on the CPU) cost
almost no RSS at start, stats() says reserved vs committed, and committed memory grows with use.
RSS is measured with psutil in a fresh interpreter (so other tests' allocations do not blur it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

psutil = pytest.importorskip("psutil")

SCRIPT = r"""
import json, os, psutil, torch
torch.set_num_threads(1)
from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.testing import tiny_llama
proc = psutil.Process()
model = tiny_llama()
rss0 = proc.memory_info().rss
store = SessionStore(model, "1GiB", host_capacity="4GiB", hidden_states=HIDDEN)
rss1 = proc.memory_info().rss
st1 = store.stats()
engine = Engine(model, None, store=store)
ids = list(range(3, 3 + 200))
out = engine.submit("a", ids, SamplingParams(max_new_tokens=8)).result()
ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
store.move("a", range(len(store.session("a").chunks)), "host")
st2 = store.stats()
print(json.dumps({"rss0": rss0, "rss1": rss1, "exact": list(out.token_ids) == ref,
                  "st1": [st1.device_reserved_bytes, st1.device_committed_bytes, st1.host_reserved_bytes,
                          st1.host_committed_bytes],
                  "st2": [st2.device_reserved_bytes, st2.device_committed_bytes, st2.host_reserved_bytes,
                          st2.host_committed_bytes, st2.host_tokens, st2.kv_bytes_per_token]}))
"""

GiB, MiB = 2**30, 2**20


@pytest.mark.parametrize("hidden", ["never", "always"])
def test_pools_commit_memory_as_used(hidden):
    out = subprocess.run([sys.executable, "-c", SCRIPT.replace("HIDDEN", repr(hidden))], capture_output=True,
                         text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["rss1"] - r["rss0"]
    print(f"hidden={hidden}: RSS before the store {r['rss0'] / MiB:.0f} MiB, after {r['rss1'] / MiB:.0f} MiB "
          f"(+{grew / MiB:.1f} MiB for a 1 GiB device pool and a 4 GiB host tier)")
    assert grew < 64 * MiB, f"creating the store took {grew / MiB:.0f} MiB"
    dev_res, dev_com, host_res, host_com = r["st1"]
    assert dev_res == GiB and host_res >= 4 * GiB - MiB
    assert dev_com < MiB and host_com < MiB
    dev_res2, dev_com2, host_res2, host_com2, host_tokens, per_token = r["st2"]
    assert r["exact"]
    assert host_tokens >= 200 and host_res2 == host_res
    assert 0 < dev_com2 < 16 * MiB                          # pages under the blocks written, not the pool
    assert host_tokens * per_token // 4 <= host_com2 < 16 * MiB
