"""A turn's cost as sessions that share a system prompt accumulate, the device full.

    python -m benchmarks.bench_shared_prefix --sessions 10000 --json benchmarks/results/bench_shared_prefix.json

Every session starts with the same `--system` tokens (one full chunk at the default 32: the chunk every
conversation of a chat template with a system prompt shares) and `--own` tokens of its own. Sessions are
served one turn each, one after another, through `Engine` (tiny Llama, 2 torch threads) on a store whose
device holds `--device-tokens`: once it is full, each turn moves idle chunks down to the host (and the
host's to the disk tier, with `--disk`), and the victims are chosen by the eviction walk
(`cache/eviction/fair_walk.py`), which reads the device's holders. Reported: the mean milliseconds of a turn
over each block of `--every` sessions (against the session count), and each answer checked against
stateless greedy `generate` on a sample (`--verify`). A cost that grows with the sessions held is the walk
reading holders whose only device chunk is the shared one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from stateful_hf import Engine, SamplingParams, SessionStore
from stateful_hf.cache import FairSharePolicy
from stateful_hf.testing import tiny_llama


def prompt(i: int, system: list[int], own: int) -> list[int]:
    """Session i's first prompt: the shared system tokens, then `own` ids that no other session has."""
    digits = [3 + (i // 300 ** d) % 300 for d in range(3)]          # unique for i < 300^3
    return system + digits + [5 + (i * 7 + j) % 300 for j in range(max(own - 3, 0))]


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns what its JSON holds (a wrong answer makes the command exit 1)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--system", type=int, default=32, help="tokens every session shares (0: none, the control)")
    ap.add_argument("--own", type=int, default=16, help="tokens of each session's own")
    ap.add_argument("--device-tokens", type=int, default=65536)
    ap.add_argument("--disk", action="store_true", help="a disk tier below the host (write-behind on)")
    ap.add_argument("--fair", action="store_true", help="the fair share over the default policy (the server's default)")
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--verify", type=int, default=50, help="answers checked against stateless generate")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = tiny_llama()
    system = [5 + (j * 11) % 300 for j in range(a.system)]
    disk = tempfile.TemporaryDirectory(prefix="bench_shared_") if a.disk else None
    held = a.sessions * (a.system + a.own + 32) + 4096
    store = SessionStore(model, a.device_tokens, host_capacity=held if disk is None else 4 * a.device_tokens,
                         **({"disk_dir": disk.name, "disk_capacity": held} if disk is not None else {}))
    if a.fair:
        store.policy = FairSharePolicy(store.policy)
    engine = Engine(model, store=store, on_busy="wait").start()
    engine.warm_up()
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    blocks, answers, t0, times = [], {}, time.perf_counter(), []
    for i in range(a.sessions):
        t = time.perf_counter()
        answers[i] = list(engine.submit(f"s{i}", prompt(i, system, a.own), sampling).result().token_ids)
        times.append(time.perf_counter() - t)
        if (i + 1) % a.every == 0:
            blocks.append({"sessions": i + 1, "turn_ms_mean": round(1e3 * statistics.fmean(times), 2),
                           "turn_ms_p50": round(1e3 * statistics.median(times), 2)})
            print(f"{i + 1:6d} sessions: a turn {blocks[-1]['turn_ms_mean']:.1f} ms mean, "
                  f"{blocks[-1]['turn_ms_p50']:.1f} ms p50", flush=True)
            times = []
    wall = time.perf_counter() - t0
    stats = store.stats()
    engine.stop(flush=None)
    store.check_integrity()
    wrong = 0
    step = max(a.sessions // max(a.verify, 1), 1)
    for i in range(0, a.sessions, step)[:a.verify]:
        ids = torch.tensor([prompt(i, system, a.own)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             pad_token_id=0)
        wrong += out[0, ids.shape[1]:].tolist() != answers[i]
    store.close()
    if disk is not None:
        disk.cleanup()
    print(f"{a.sessions} turns in {wall:.1f} s; shared tokens {stats.shared_tokens}, device {stats.device_tokens}, "
          f"host {stats.host_tokens}, disk {stats.disk_tokens}; wrong answers {wrong} of {min(a.verify, a.sessions)}")
    out = {"command": " ".join(["python -m benchmarks.bench_shared_prefix", *(sys.argv[1:] if argv is None else argv)]),
           "args": vars(a), "blocks": blocks, "wall_s": wall, "wrong": wrong, "verified": min(a.verify, a.sessions),
           "cpus": os.cpu_count(), "load": os.getloadavg(), "shared_tokens": stats.shared_tokens}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["wrong"] else 0)
